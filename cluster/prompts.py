"""Normalizing what callers hand to ``generate``: one prompt or many, one params or one per prompt."""

from __future__ import annotations

from collections.abc import Sequence

from processors import SamplingParams

Prompt = str | list[int]


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt (text, or a list of token ids) becomes a list of one."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params

"""Normalizing what callers hand to ``generate``: one prompt or many, one params or one per prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from processors import LoRARequest, SamplingParams

Prompt = str | list[int]
PromptInput = Prompt | dict  # vLLM's TextPrompt {"prompt": ...} and TokensPrompt {"prompt_token_ids": ...} too
# One SamplingParams (or a dict of its fields) for every prompt, or one per prompt.
Params = SamplingParams | dict | Sequence[SamplingParams | dict | None] | None
PROMPT_KEYS = ("prompt", "prompt_token_ids")
FORMS = ('a string, a list of token ids, a {"prompt": ...} or {"prompt_token_ids": ...} dict, '
         "or a list of these")


def as_prompt(prompt: PromptInput) -> Prompt:
    """One prompt in any accepted form, as text or token ids; a dict vLLM takes but we do not is refused."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        what = "multi-modal data is" if any("multi_modal" in k for k in unknown) else f"prompt key(s) {unknown} are"
        raise ValueError(f"{what} not supported: a prompt dict takes 'prompt' or 'prompt_token_ids'")
    given = [k for k in PROMPT_KEYS if k in prompt]
    if len(given) != 1:
        raise ValueError("a prompt dict needs exactly one of 'prompt' (text) or 'prompt_token_ids' (a list of ids)")
    return prompt[given[0]]


def as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[Prompt]:
    """A single prompt (text, a list of token ids, or a vLLM prompt dict) becomes a list of one."""
    if prompts is None or isinstance(prompts, (bytes, int, float)):
        raise TypeError(f"prompts must be {FORMS}; got {type(prompts).__name__}")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [as_prompt(prompts)]  # type: ignore[arg-type]
    return [as_prompt(p) for p in prompts]  # type: ignore[union-attr]


PARAMS_FORMS = "a SamplingParams, a dict of its fields, or a list of these (one per prompt)"


def as_params(params: SamplingParams | dict | None) -> SamplingParams | None:
    """A dict holds vLLM's ``SamplingParams`` fields; anything else is refused, naming what is expected."""
    if params is None or isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise TypeError(f"sampling_params must be {PARAMS_FORMS}; got {type(params).__name__}")


def params_per_prompt(params: Params, n: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, (SamplingParams, dict)):
        return [as_params(params)] * n
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise TypeError(f"sampling_params must be {PARAMS_FORMS}; got {type(params).__name__}")
    params = [as_params(p) for p in params]
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def with_lora(params: Params, lora_request: Any, n: int) -> Params:
    """Each prompt's params carrying its LoRA adapter: vLLM's ``lora_request``, one for every prompt or a
    list of one per prompt (None: the base model). A prompt given no params keeps the engine's defaults."""
    if lora_request is None:
        return params
    loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_request for {n} prompts")
    carried: list[SamplingParams | None] = []
    for one, lora in zip(params_per_prompt(params, n), loras):
        if lora is not None and not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest (raysample.LoRARequest) or a list of them; "
                            f"got {type(lora).__name__}")
        if lora is not None:
            one = SamplingParams(_engine_defaults=True) if one is None else one.clone()
            one._lora = lora
        carried.append(one)
    return carried

"""transformers' float32 log-softmax of a prompt: the reference prompt logprobs are checked against."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=2)
def reference_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def reference_logprobs(path: str | Path, prompt: list[int]) -> torch.Tensor:
    """``(len(prompt) - 1, vocab)``: row i is the logprobs of every token at position i + 1."""
    with torch.inference_mode():
        logits = reference_model(str(path))(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def check_against(reference: torch.Tensor, prompt: list[int], positions: list, top: int, tolerance: float) -> None:
    """``positions``: vLLM's prompt logprobs (None first, then dicts of token -> Logprob)."""
    assert len(positions) == len(prompt) and positions[0] is None
    for i, (token, position) in enumerate(zip(prompt[1:], positions[1:])):
        want = reference[i]
        got = position[token]
        assert abs(got.logprob - float(want[token])) <= tolerance, (i, got.logprob, float(want[token]))
        assert got.rank == int((want >= want[token] - 1e-9).sum()) or abs(
            float(want.sort(descending=True).values[got.rank - 1]) - float(want[token])) <= tolerance, (i, got.rank)
        best = sorted((lp.rank, t) for t, lp in position.items() if t != token or lp.rank <= top)
        assert len(position) in (top, top + 1)
        for rank, t in best[:top]:
            assert abs(position[t].logprob - float(want.sort(descending=True).values[rank - 1])) <= tolerance

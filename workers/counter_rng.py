"""Counter-based randomness: every random number is a pure function of
(request key, absolute token position, token id).

A seeded request therefore draws the same noise whichever worker samples it,
whatever row it sits in and whatever else is in the batch. The mixing
function is SplitMix64's finalizer on int64 tensors (logical shifts emulated
with masks, multiplication wrapping as two's complement on CPU and CUDA).
"""

from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MUL1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685  # 0x94D049BB133111EB
_POSITION_STRIDE = 0x2545F4914F6CDD1D
_U23 = 1 << 23


def _xor_shift(h: torch.Tensor, shift: int) -> torch.Tensor:
    return h ^ ((h >> shift) & ((1 << (64 - shift)) - 1))


def mix64(h: torch.Tensor) -> torch.Tensor:
    h = _xor_shift(h, 30) * _MUL1
    h = _xor_shift(h, 27) * _MUL2
    return _xor_shift(h, 31)


def stream_base(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(rows,) int64 state for each (key, position) pair."""
    return mix64(mix64(keys.to(torch.int64)) + positions.to(torch.int64) * _POSITION_STRIDE)


def uniform(base: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [2^-24, 1 - 2^-24] for (rows,) bases and (rows, n) or (n,) token ids.

    23 random bits with a half-step offset: every value is exact in float32,
    and neither 0 nor 1 can occur, so the logs below stay finite.
    """
    h = mix64(base.unsqueeze(-1) + token_ids.to(torch.int64) * _GOLDEN)
    bits = (h >> 41) & (_U23 - 1)
    return (bits.to(torch.float32) + 0.5) * (1.0 / _U23)


def gumbel(base: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise: argmax(logits + noise) samples from softmax(logits)."""
    return uniform(base, token_ids).log_().neg_().log_().neg_()

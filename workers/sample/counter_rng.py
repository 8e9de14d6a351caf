"""Counter-based randomness: every random number is a pure function of
(request key, absolute token position, token id).

A seeded request therefore draws the same noise whichever worker samples it,
whatever row it sits in and whatever else is in the batch. The mixing
function is SplitMix64's finalizer on int64 tensors (logical shifts emulated
with masks, multiplication wrapping as two's complement on CPU and CUDA).

``gumbel_argmax`` samples ``softmax(logits)`` per row exactly. The noise is
bounded (see ``GUMBEL_MIN``/``GUMBEL_MAX``), so a token more than
``GUMBEL_SPAN`` below its row's maximum can never win: rows where few tokens
are within that span (any row after top-k, top-p or min-p, and peaked rows)
get noise only for those tokens; other rows are processed densely in
cache-sized chunks with in-place integer ops. On a GPU every row is processed
densely in one pass: choosing the sparse rows needs the counts on the host (a
sync per chunk), and the noise of a whole batch is a few elementwise kernels
there. Both ways add the same noise to the same logits, so the tokens are the
same.
"""

from __future__ import annotations

import math

import torch

from workers.sample.row_argmax import row_max_argmax

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MUL1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685  # 0x94D049BB133111EB
_POSITION_STRIDE = 0x2545F4914F6CDD1D
_BITS = 23
_SCALE = 1.0 / (1 << _BITS)

# Uniforms lie in [2^-24, 1 - 2^-24], so Gumbel noise -log(-log(u)) is bounded.
GUMBEL_MAX = -math.log(-math.log1p(-(2.0**-24)))  # ~16.64
GUMBEL_MIN = -math.log(24 * math.log(2))  # ~-2.81
GUMBEL_SPAN = GUMBEL_MAX - GUMBEL_MIN + 0.05  # margin for float32 rounding
_CHUNK_BYTES = 4 << 20  # on CPU: the int64 noise of a chunk stays in cache
_DEVICE_CHUNK_BYTES = 1 << 30  # on a GPU: one pass for any batch that is not huge
_SPARSE_FRACTION = 0.125


def _chunk_bytes(device: torch.device) -> int:
    return _CHUNK_BYTES if device.type == "cpu" else _DEVICE_CHUNK_BYTES


def _xor_shift_(h: torch.Tensor, shift: int, tmp: torch.Tensor) -> None:
    torch.bitwise_right_shift(h, shift, out=tmp)
    tmp.bitwise_and_((1 << (64 - shift)) - 1)
    h.bitwise_xor_(tmp)


def mix64_(h: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer, in place."""
    tmp = torch.empty_like(h)
    _xor_shift_(h, 30, tmp)
    h.mul_(_MUL1)
    _xor_shift_(h, 27, tmp)
    h.mul_(_MUL2)
    _xor_shift_(h, 31, tmp)
    return h


def _wrap64(value: int) -> int:
    """A Python int reduced to int64 two's complement, as tensor arithmetic would wrap it."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def stream_base(keys: torch.Tensor, positions: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """(rows,) int64 state for each (key, position) pair; ``salt`` picks an independent stream."""
    h = mix64_(keys.to(torch.int64) + _wrap64(salt * _GOLDEN))
    return mix64_(h + positions.to(torch.int64) * _POSITION_STRIDE)


def _gumbel_from_hash_(h: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise from mixed hashes (consumes ``h``)."""
    h.bitwise_right_shift_(64 - _BITS)
    h.bitwise_and_((1 << _BITS) - 1)
    u = h.to(torch.float32).add_(0.5).mul_(_SCALE)
    return u.log_().neg_().log_().neg_()


def uniform(base: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [2^-24, 1 - 2^-24]; ``base`` and ``token_ids`` broadcast.

    23 random bits with a half-step offset: every value is exact in float32 and
    neither 0 nor 1 occurs.
    """
    h = mix64_(base + token_ids.to(torch.int64) * _GOLDEN)
    h.bitwise_right_shift_(64 - _BITS)
    h.bitwise_and_((1 << _BITS) - 1)
    return h.to(torch.float32).add_(0.5).mul_(_SCALE)


def gumbel(base: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (bounded to [GUMBEL_MIN, GUMBEL_MAX]); arguments broadcast."""
    return _gumbel_from_hash_(mix64_(base + token_ids.to(torch.int64) * _GOLDEN))


def _dense_argmax(logits: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    golden_ids = torch.arange(vocab, device=logits.device, dtype=torch.int64).mul_(_GOLDEN)
    chunk = max(1, _chunk_bytes(logits.device) // (8 * vocab))
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        h = golden_ids.unsqueeze(0) + base[start:stop].unsqueeze(1)
        noise = _gumbel_from_hash_(mix64_(h))
        out[start:stop] = row_max_argmax(noise.add_(logits[start:stop]))[1]
    return out


def _sparse_argmax(logits: torch.Tensor, base: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    r, t = candidates.nonzero(as_tuple=True)
    score = logits[r, t] + gumbel(base[r], t)
    best = torch.full((rows,), float("-inf"), device=logits.device).scatter_reduce_(0, r, score, "amax")
    winner = score == best[r]
    # Lowest token id among equal scores, as argmax would pick.
    out = torch.full((rows,), vocab, dtype=torch.int64, device=logits.device)
    return out.scatter_reduce_(0, r[winner], t[winner], "amin")


def _argmax_chunk(logits: torch.Tensor, base: torch.Tensor, row_max: torch.Tensor,
                  dense: bool = False) -> torch.Tensor:
    """Fills ``row_max`` (rows, 1) with each row's maximum; a row where it is not finite gets token 0.
    ``dense``: every row through the dense pass, with no host sync (the GPU's way)."""
    rows, vocab = logits.shape
    torch.amax(logits, dim=-1, keepdim=True, out=row_max)
    if dense:
        out = _dense_argmax(logits, base)
        return out.masked_fill_(~torch.isfinite(row_max.squeeze(1)), 0)
    candidates = logits >= row_max - GUMBEL_SPAN
    counts = candidates.view(torch.uint8).sum(dim=-1, dtype=torch.int32)
    sparse = counts <= max(1, int(vocab * _SPARSE_FRACTION))
    out = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    if bool(sparse.any()):
        idx = sparse.nonzero(as_tuple=True)[0]
        out[idx] = _sparse_argmax(logits[idx], base[idx], candidates[idx])
    if not bool(sparse.all()):
        idx = (~sparse).nonzero(as_tuple=True)[0]
        out[idx] = _dense_argmax(logits[idx], base[idx])
    return out.masked_fill_(~torch.isfinite(row_max.squeeze(1)), 0)


def gumbel_argmax(logits: torch.Tensor, base: torch.Tensor, rows: torch.Tensor | None = None,
                  row_max: torch.Tensor | None = None, dense: bool | None = None) -> torch.Tensor:
    """argmax(logits + Gumbel(base, token id)) per row: an exact sample of softmax(logits).

    ``rows`` (local indices) picks the rows to sample, ``base`` has one entry
    per picked row. ``row_max``, if given (one float32 per picked row), receives each row's
    maximum logit, computed here anyway: NaN, +inf or -inf exactly when the row has a NaN, a +inf
    or every token masked. Such a row returns token 0 (the caller fails its request).
    ``dense``: skip the sparse rows' shortcut (default: on a GPU); the tokens are the same either way.
    """
    n = logits.shape[0] if rows is None else rows.numel()
    dense = logits.device.type != "cpu" if dense is None else dense
    step = max(1, _chunk_bytes(logits.device) // (4 * logits.shape[1]))
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    maxima = row_max.view(n, 1) if row_max is not None else torch.empty(n, 1, dtype=logits.dtype, device=logits.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        chunk = logits[start:stop] if rows is None else logits.index_select(0, rows[start:stop])
        out[start:stop] = _argmax_chunk(chunk, base[start:stop], maxima[start:stop], dense)
    return out

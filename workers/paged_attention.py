"""Attention over a paged KV cache, as a transformers ``AttentionInterface`` function.

Every new token of a step is packed into one sequence ``[1, N]``. For each
layer the function first writes the new tokens' K/V into their cache slots
(block id, offset), then attends per row over the row's blocks, gathered
block-wise from the pool. Masking is by absolute position, so K/V of a block's
previous owner beyond a row's length is never seen, and per layer it honours
what transformers passes to every attention function: ``sliding_window``,
``softcap`` (attention logit soft-capping) and ``s_aux`` (attention sinks).
Anything else that would change attention is refused (``UnsupportedAttention``)
rather than ignored.

Rows are attended in groups: one-token rows (decode) together, short multi-token
rows (draft verification) together padded to the longest, and long rows
(prefill chunks) one by one, so no mask grows as rows x queries x keys with
the longest prompt of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_NAME = "raysample_paged"
SHORT_QUERY_LIMIT = 16  # multi-token rows up to this many queries are batched together
_MASKED = -1e30  # finite: a padding query with every key masked gives zeros, not NaN

# Every argument that changes the result in any eager attention function of transformers 5.2x is
# either honoured here (sliding_window, softcap, s_aux/sinks) or listed and refused; other keyword
# arguments (router flags, cache positions) do not enter attention. The load-time probe checks the rest.
_REFUSED_KWARGS = {"position_bias": "relative position biases", "alibi": "ALiBi biases",
                   "attention_bias": "additive attention biases"}


class UnsupportedAttention(RuntimeError):
    """The model asks for an attention feature this runner cannot reproduce exactly."""


class PagedKVCache:
    """Per-layer K/V pools ``[kv_heads, num_blocks, block_size, head_dim]``.

    Kv-head-major so that gathering a row's blocks yields ``[kv_heads, rows, keys, head_dim]``
    without a second copy.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (kv_heads, num_blocks, block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


@dataclass
class AttentionGroup:
    """Rows attended together; queries padded to ``q_len`` and keys to ``blocks_per_row * block_size``."""

    q_len: int
    tokens: torch.Tensor  # (n_valid,) packed indices of the real queries, row-major
    token_index: torch.Tensor  # (rows, q_len) packed index of each query (padding: 0)
    valid_flat: torch.Tensor  # (n_valid,) positions of the real queries in rows * q_len
    query_pos: torch.Tensor  # (rows, q_len) absolute positions, -1 for padding
    block_index: torch.Tensor  # (rows * blocks_per_row,) pool blocks of each row, padded with 0
    rows: int
    key_len: int
    _masks: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def masks(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool allowed, additive float) masks ``(rows, q_len, key_len)`` for this window; built once per step."""
        if window not in self._masks:
            keys = torch.arange(self.key_len, device=self.query_pos.device).view(1, 1, -1)
            pos = self.query_pos.unsqueeze(-1)
            allowed = keys <= pos
            if window is not None:
                allowed &= keys > pos - window
            additive = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            self._masks[window] = (allowed, additive.masked_fill_(~allowed, _MASKED))
        return self._masks[window]


@dataclass
class PackedStep:
    """Everything the attention function needs for one forward, shared by every layer."""

    cache: PagedKVCache
    write_block: torch.Tensor  # (N,)
    write_offset: torch.Tensor  # (N,)
    groups: list[AttentionGroup]
    seen_kwargs: set[str] = field(default_factory=set)


def _window(sliding_window: Any) -> int | None:
    if sliding_window is None:
        return None
    window = int(sliding_window)
    if window <= 0:
        raise UnsupportedAttention(f"sliding_window={sliding_window!r} is not a positive window")
    return window


def _manual_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive: torch.Tensor,
                      scaling: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Eager semantics. q ``(kv, rows, g, q, d)``; k, v ``(kv, rows, L, d)``; additive ``(rows, q, L)``.

    Returns ``(kv, rows, g, q, d)``.
    """
    kv, rows, groups, q_len, dim = q.shape
    scores = torch.matmul(q.reshape(kv, rows, groups * q_len, dim).to(k.dtype), k.transpose(-1, -2))
    scores = scores.view(kv, rows, groups, q_len, -1).float().mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = scores + additive.unsqueeze(0).unsqueeze(2)
    if sinks is not None:
        sink = sinks.float().view(kv, 1, groups, 1, 1).expand(kv, rows, groups, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(kv, rows, groups * q_len, -1).to(v.dtype), v)
    return out.view(kv, rows, groups, q_len, dim)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, heads, N, head_dim), RoPE applied
    key: torch.Tensor,  # (1, kv_heads, N, head_dim), new tokens only
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    packed_step: PackedStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if packed_step is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs the packed_step argument (use ModelRunner)")
    refused = sorted(name for name in _REFUSED_KWARGS if kwargs.get(name) is not None)
    if refused:
        raise UnsupportedAttention(", ".join(f"{_REFUSED_KWARGS[n]} ({n})" for n in refused) + " are not supported")
    if s_aux is None:
        s_aux = kwargs.get("sinks")
    packed_step.seen_kwargs.update(n for n, v in (("sliding_window", sliding_window), ("softcap", softcap),
                                                  ("s_aux", s_aux)) if v is not None)
    window = _window(sliding_window)
    layer = module.layer_idx
    cache = packed_step.cache
    k_pool, v_pool = cache.keys[layer], cache.values[layer]
    k_pool[:, packed_step.write_block, packed_step.write_offset] = key[0].to(k_pool.dtype)
    v_pool[:, packed_step.write_block, packed_step.write_offset] = value[0].to(v_pool.dtype)

    heads, n_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = k_pool.shape[0]
    groups_per_kv = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    out = query.new_empty(n_tokens, heads, head_dim)
    q_all = query[0].transpose(0, 1)  # (N, heads, head_dim)
    for group in packed_step.groups:
        # (kv, rows * blocks, bs, d) -> (kv, rows, L, d): one block-wise gather per group and layer.
        k = k_pool.index_select(1, group.block_index).view(kv_heads, group.rows, group.key_len, head_dim)
        v = v_pool.index_select(1, group.block_index).view(kv_heads, group.rows, group.key_len, head_dim)
        q = q_all[group.token_index]  # (rows, q, heads, d)
        allowed, additive = group.masks(window)
        if softcap is None and s_aux is None and group.q_len > 1:
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2).to(k.dtype), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed.unsqueeze(1),
                scale=scale, enable_gqa=True,
            )  # (rows, heads, q, d)
            flat = attn.transpose(1, 2).reshape(-1, heads, head_dim)
        else:
            q = q.view(group.rows, group.q_len, kv_heads, groups_per_kv, head_dim).permute(2, 0, 3, 1, 4)
            attn = _manual_attention(q, k, v, additive, scale, softcap, s_aux)  # (kv, rows, g, q, d)
            flat = attn.permute(1, 3, 0, 2, 4).reshape(-1, heads, head_dim)
        out[group.tokens] = flat[group.valid_flat].to(out.dtype)
    return out.unsqueeze(0), None  # (1, N, heads, head_dim)


def register_paged_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)

"""Attention over the paged KV cache with torch's FlexAttention: one maintained kernel for every step
shape on a GPU (decode rows, prompt chunks, draft verification), reading K/V where they lie.

A layer's pool ``[blocks, kv_heads, block_size, head_dim]`` is, to FlexAttention, one long key
sequence: its (block, kv head) tiles in pool order, ``block_size`` keys each. Each query row's block
mask lists the tiles of its own block table for its kv head, so the kernel visits exactly the keys
the row owns, with no copy of K/V and no padding of a row to the longest; inside those tiles the
mask function masks by absolute position (and sliding window), using a map from each pool block to
its index in the tables (a prefix-shared block sits at the same index in every table that holds it).
Soft-capping is a score modification; attention sinks rescale the output by the log-sum-exp the
kernel returns (the sink's share of the softmax), so the arithmetic is eager attention's.

On CUDA the call is compiled (Triton kernels, captured in the decode graphs); elsewhere torch runs
its dense reference implementation, which the CPU tests compare with the reference attention on
random layouts. The CPU's own decode kernel (``workers.cpu.native_attention``) stays the CPU's path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

Q_BLOCK = 128  # queries per tile of the kernel (a decode row has one)


@dataclass
class FlexLayout:
    """Which keys each query row may read, for every layer of one forward.

    ``tables``: ``(rows, width)`` pool blocks of each row (padding entries past a row's last block are
    never visited); ``query_pos``: ``(rows, q_len)`` absolute positions, -1 for padding queries;
    ``logical``: ``(pool blocks + 1,)`` each block's index in the tables that hold it."""

    tables: torch.Tensor
    query_pos: torch.Tensor
    logical: torch.Tensor
    kv_heads: int
    heads: int
    block_size: int
    pool_blocks: int
    _masks: dict[int | None, Any] = field(default_factory=dict)

    def block_mask(self, window: int | None) -> Any:
        """The ``BlockMask`` for this window, built once per forward and shared by its layers."""
        if window not in self._masks:
            self._masks[window] = _block_mask(self, window)
        return self._masks[window]


def index_blocks(tables: torch.Tensor, query_pos: torch.Tensor, block_size: int, logical: torch.Tensor) -> None:
    """``logical`` (``pool blocks + 1`` entries) with each block a row reads mapped to its column; a table's
    padding entries (past the row's last query) go to the last entry, unread: a padding entry may name a
    block another row holds at another column. Tensor ops only, so a captured graph refreshes it each replay."""
    columns = torch.arange(tables.shape[1], device=tables.device).expand_as(tables)
    needed = query_pos.amax(dim=1, keepdim=True) // block_size + 1  # 0 for a row of padding queries
    target = torch.where(columns < needed, tables, logical.shape[0] - 1)
    logical.scatter_(0, target.reshape(-1), columns.reshape(-1))


def flex_layout(tables: torch.Tensor, query_pos: torch.Tensor, pool_blocks: int, kv_heads: int, heads: int,
                block_size: int, logical: torch.Tensor | None = None) -> FlexLayout:
    """The layout of one forward; ``logical``: a persistent ``pool blocks + 1`` buffer to fill (a captured
    graph's), else a new one."""
    if logical is None:
        logical = torch.zeros(pool_blocks + 1, dtype=torch.long, device=tables.device)
    index_blocks(tables, query_pos, block_size, logical)
    return FlexLayout(tables, query_pos, logical, kv_heads, heads, block_size, pool_blocks)


def _block_mask(layout: FlexLayout, window: int | None) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    tables, query_pos = layout.tables, layout.query_pos
    rows, q_len = query_pos.shape
    width = tables.shape[1]
    kv, heads, bs = layout.kv_heads, layout.heads, layout.block_size
    groups = heads // kv
    q_blocks = -(-q_len // Q_BLOCK)
    padded = torch.full((rows, q_blocks * Q_BLOCK), -1, dtype=query_pos.dtype, device=query_pos.device)
    padded[:, :q_len] = query_pos
    last = padded.view(rows, q_blocks, Q_BLOCK).amax(dim=-1)  # each query tile's last position (-1: none)
    needed = torch.where(last >= 0, last // bs + 1, 0).clamp(max=width).to(torch.int32)  # (rows, q_blocks)
    head_of = torch.arange(heads, device=tables.device) // groups
    tiles = tables.view(rows, 1, 1, width) * kv + head_of.view(1, heads, 1, 1)  # (rows, heads, 1, width)
    tiles = tiles.expand(rows, heads, q_blocks, width)
    if tables.device.type != "cuda":
        # torch's dense reference implementation indexes a dense mask by tile: it needs every tile's column.
        tiles = torch.cat([tiles, tiles.new_zeros(rows, heads, q_blocks, layout.pool_blocks * kv - width)], dim=-1)
    kv_num_blocks = needed.view(rows, 1, q_blocks).expand(rows, heads, q_blocks).contiguous()
    logical = layout.logical
    per_block = kv * bs

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        block = kv_idx // per_block
        column = logical[block].clamp(0, width - 1)
        key_pos = column * bs + kv_idx % bs
        pos = query_pos[b, q_idx]
        allowed = (tables[b, column] == block) & ((kv_idx // bs) % kv == h // groups) & (key_pos <= pos) & (pos >= 0)
        if window is not None:
            allowed = allowed & (key_pos > pos - window)
        return allowed

    return BlockMask.from_kv_blocks(kv_num_blocks, tiles.to(torch.int32).contiguous(), BLOCK_SIZE=(Q_BLOCK, bs),
                                    mask_mod=mask_mod, seq_lengths=(q_len, layout.pool_blocks * per_block),
                                    compute_q_blocks=False)


@lru_cache(maxsize=1)
def _compiled() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True)


def _flex(device: torch.device) -> Any:
    if device.type == "cuda":
        return _compiled()
    import torch.nn.attention.flex_attention as flex

    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # the dense reference, without a warning every call
    return flex.flex_attention


def flex_paged_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layout: FlexLayout,
                         scale: float, softcap: float | None = None, window: int | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``query`` ``(rows, heads, q_len, head_dim)`` over the pools -> the same shape, in the query's dtype.
    A padding query (position -1) attends to nothing and gives zeros."""
    rows = query.shape[0]
    head_dim = k_pool.shape[-1]
    if query.shape[1] != layout.heads or k_pool.shape[1] != layout.kv_heads:
        raise ValueError(f"FlexAttention layout for {layout.heads} heads over {layout.kv_heads} KV heads, given "
                         f"{query.shape[1]} over {k_pool.shape[1]}")
    keys = k_pool.view(1, 1, -1, head_dim).expand(rows, 1, -1, head_dim)  # the pool, shared by every row
    values = v_pool.view(1, 1, -1, head_dim).expand(rows, 1, -1, head_dim)
    score_mod = None
    if softcap is not None:
        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return torch.tanh(score / softcap) * softcap
    q = query if query.dtype == k_pool.dtype else query.to(k_pool.dtype)
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = _flex(query.device)(q, keys, values, score_mod=score_mod, block_mask=layout.block_mask(window),
                                   scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    lse = aux.lse
    if sinks is not None:  # a sink takes exp(sink) / (Z + exp(sink)) of the softmax: the keys keep the rest
        sink = sinks.float().view(1, -1, 1)
        out = out * torch.sigmoid(lse.float() - sink).unsqueeze(-1).to(out.dtype)
    return out if out.dtype == query.dtype else out.to(query.dtype)

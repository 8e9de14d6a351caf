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

Rows are attended in groups: decode rows (the last generated token, plus drafts to
verify, up to ``SHORT_QUERY_LIMIT`` queries) together, and prompt chunks in padded
batches (SDPA), so no mask grows as rows x queries x keys with the longest prompt of
the batch. The decode rows go to the C++ CPU kernel (``NativeDecode``) where it is in
use, else to one block-major group padded to the longest, reading each KV block once
where it lies (any device; also the kernel's reference in the tests). Which kernel a
token meets depends on what it is, never on how its prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from workers.cpu.host_memory import lazy_zeros
from workers.cpu.native_attention import paged_decode as native_paged_decode
from workers.cpu.native_attention import paged_decode_op as native_paged_decode_op
from workers.cpu.native_attention import write_kv as native_write_kv
from workers.model.flex_paged import FlexLayout, flex_layout, flex_paged_attention

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
    """Per-layer K/V pools ``[num_blocks, kv_heads, block_size, head_dim]``.

    Block-major, so a range of blocks is one contiguous batch of small matrices: decode
    attention reads K/V where they lie, without gathering them.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.keys = [_zeros(shape, dtype, torch.device(device)) for _ in range(num_layers)]
        self.values = [_zeros(shape, dtype, torch.device(device)) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        # (blocks * kv_heads * block_size, head_dim) views, where a write slot indexes a token's row.
        self.flat_keys = [pool.view(-1, head_dim) for pool in self.keys]
        self.flat_values = [pool.view(-1, head_dim) for pool in self.values]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU in their own mapping (``workers.cpu.host_memory.lazy_zeros``), committed as blocks
    are first written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return lazy_zeros(shape, dtype)


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
    _flex: FlexLayout | None = None

    def flex_layout(self, cache: PagedKVCache, kv_heads: int, heads: int) -> FlexLayout:
        """The group's FlexAttention layout (``workers.model.flex_paged``), built once per step."""
        if self._flex is None:
            tables = self.block_index.view(self.rows, -1)
            self._flex = flex_layout(tables, self.query_pos, cache.num_blocks, kv_heads, heads, cache.block_size)
        return self._flex

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
class BlockMajorDecode:
    """Rows of up to ``q_len`` queries (decode, draft verification), attended block by block.

    Scores are computed for every block of a few pool ranges (``segments``, back to back) against
    the queries of the row that owns it (unowned blocks are masked), then gathered per row for the
    softmax; the probabilities go back to their blocks to multiply V where it lies. Only scores and
    per-block outputs are gathered, never K/V (except one compact copy when blocks are scattered).
    Built by ``workers.model.decode_layout``.
    """

    segments: list[tuple[int, int]]  # pool block ranges [lo, hi); entries 0.. are their blocks in order
    gather: torch.Tensor | None  # blocks to copy into one compact range first (then segments = [(0, len)])
    q_len: int
    token_index: torch.Tensor  # (rows, q_len) packed index of each query (padding: 0)
    tokens: torch.Tensor  # (n_valid,) packed indices of the real queries, row-major
    valid_flat: torch.Tensor  # (n_valid,) their positions in rows * q_len
    row_of_block: torch.Tensor  # (span,) row owning each block of the segments, 0 for unowned (masked)
    # Entries: the span blocks of the segments, then ``lanes`` entries per shared block (one per row
    # reading it; padding lanes are masked). A row's j-th block is entry row_blocks[row, j].
    row_blocks: torch.Tensor  # (rows, blocks_per_row); padding: a masked entry
    key_pos: torch.Tensor  # (entries, block_size) absolute key positions; -1 where masked
    query_pos: torch.Tensor  # (entries, q_len) positions of the entry's row's queries; -1 for padding
    # The masked entry padding points at (rows with fewer blocks); None when no row is padded.
    pad_entry: int | None = None
    shared_blocks: torch.Tensor | None = None  # (S,) pool blocks read by several rows
    lane_rows: torch.Tensor | None = None  # (S, lanes) row of each lane; ``rows`` (a zero query) for padding
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """Additive ``(entries, 1, q_len, 1, block_size)``."""
        if window not in self._masks:
            keys, queries = self.key_pos.unsqueeze(1), self.query_pos.unsqueeze(2)  # (E, 1, bs), (E, q, 1)
            allowed = (keys >= 0) & (keys <= queries)
            if window is not None:
                allowed &= keys > queries - window
            additive = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            self._masks[window] = additive.masked_fill_(~allowed, _MASKED)[:, None, :, None, :]
        return self._masks[window]


@dataclass
class NativeDecode:
    """Rows of up to ``q_len`` queries for the C++ CPU kernel (``workers.cpu.native_attention``).

    The kernel walks each row's block table itself and reads only the keys its queries may see,
    so the layout is just the tables and the queries' places and positions.
    """

    block_tables: torch.Tensor  # (rows, width) int64 pool blocks of each row, padded with 0 (never read)
    token_index: torch.Tensor  # (rows, q_len) packed index of each query (padding: 0)
    query_pos: torch.Tensor  # (rows, q_len) absolute positions, padding queries last with -1
    tokens: torch.Tensor  # (n_valid,) packed indices of the real queries


@dataclass
class StaticDecode:
    """A forward of fixed shape (``workers.model.static_decode``): one query row per token, padded to a capture
    size, each with its request's block table padded to a fixed width. Every tensor is a view of a
    persistent buffer the runner fills before the forward, so the same kernels (a CUDA graph's, or a
    compiled graph's) serve every step; nothing here reads a tensor's value on the host. Each layer
    writes every row's K/V before any row attends, so a prompt chunk's tokens see each other.

    Padding rows sit at position 0 of the runner's padding block, which no request owns: they write
    only there and attend only to it. A real row's table is padded with that block too, masked by
    position.
    """

    block_tables: torch.Tensor  # (rows, width) pool blocks
    positions: torch.Tensor  # (rows,) the query's absolute position
    native: bool = False  # attend with the C++ CPU kernel (one opaque operator), as the variable-shape forward does
    flex: FlexLayout | None = None  # attend with FlexAttention over the pool, as the variable-shape forward does
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """Additive ``(rows, width, 1, 1, block_size)``: keys at or before the query (and inside the window)."""
        if window not in self._masks:
            rows, width = self.block_tables.shape
            keys = torch.arange(width * block_size, device=self.positions.device).view(1, width, 1, 1, block_size)
            pos = self.positions.view(rows, 1, 1, 1, 1)
            allowed = keys <= pos
            if window is not None:
                allowed &= keys > pos - window
            additive = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            self._masks[window] = additive.masked_fill_(~allowed, _MASKED)
        return self._masks[window]


@dataclass
class PackedStep:
    """Everything the attention function needs for one forward, shared by every layer."""

    cache: PagedKVCache
    # (N * kv_heads,) where each new token's K/V row goes in a pool viewed as (blocks * kv_heads *
    # block_size, head_dim), token-major: one index_copy_ per pool and layer.
    write_slots: torch.Tensor
    groups: list[AttentionGroup]
    block_major: list[BlockMajorDecode] = field(default_factory=list)
    native: NativeDecode | None = None
    native_writes: bool = False  # write K/V with the CPU kernel: write_slots checked in range by the runner
    flex: bool = False  # attend every group with FlexAttention over the pool (``workers.model.flex_paged``)
    static: StaticDecode | None = None  # a fixed-shape forward: every token is a query row of its own
    seen_kwargs: set[str] = field(default_factory=set)
    layers_called: set[int] = field(default_factory=set)


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


def _block_major_decode(dec: BlockMajorDecode, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        additive: torch.Tensor, scaling: float, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """q ``(rows, kv, G, d)`` with ``G = q_len * g`` (query-major) -> ``(rows, kv, G, d)``.

    Eager semantics, K/V read where they lie. Padding in ``row_blocks`` points at a fully masked
    entry whose probabilities are zeroed, so it adds nothing.
    """
    rows, kv, width, dim = q.shape
    k_ranges, v_ranges = k_pool, v_pool
    if dec.gather is not None:
        k_ranges, v_ranges = k_pool.index_select(0, dec.gather), v_pool.index_select(0, dec.gather)
    q = q.to(k_pool.dtype)
    span = dec.row_of_block.shape[0]
    q_blocks = q.index_select(0, dec.row_of_block)
    scores = q.new_empty(span, kv, width, k_pool.shape[2])  # (span, kv, G, bs)
    start = 0
    for lo, hi in dec.segments:
        end = start + hi - lo
        torch.matmul(q_blocks[start:end], k_ranges[lo:hi].transpose(-1, -2), out=scores[start:end])
        start = end
    if dec.shared_blocks is not None:
        # Each shared block once, against the queries of every row reading it: (S, kv, lanes * G, d).
        shared, lanes = dec.lane_rows.shape
        k_shared = k_pool.index_select(0, dec.shared_blocks)
        v_shared = v_pool.index_select(0, dec.shared_blocks)
        q_lanes = torch.cat([q, q.new_zeros(1, kv, width, dim)])[dec.lane_rows]  # (S, lanes, kv, G, d)
        q_lanes = q_lanes.transpose(1, 2).reshape(shared, kv, lanes * width, dim)
        lane_scores = torch.matmul(q_lanes, k_shared.transpose(-1, -2))  # (S, kv, lanes * G, bs)
        lane_scores = lane_scores.view(shared, kv, lanes, width, -1).transpose(1, 2).reshape(-1, kv, width,
                                                                                             scores.shape[-1])
        scores = torch.cat([scores, lane_scores])
    entries, block_size = scores.shape[0], scores.shape[-1]
    scores = scores.float().mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores.view(entries, kv, dec.q_len, -1, block_size).add_(additive)
    # Softmax over each row's (blocks, offsets): torch.softmax, whose exp stays fast on masked
    # scores (a plain exp_ of -1e30 takes a slow path, ~10x).
    per_row = scores[dec.row_blocks]  # (rows, blocks, kv, G, bs)
    rows_, blocks = per_row.shape[:2]
    flat = per_row.permute(0, 2, 3, 1, 4).reshape(rows_, kv, width, blocks * block_size)
    if sinks is not None:
        groups = width // dec.q_len
        sink = sinks.float().view(kv, 1, groups).expand(kv, dec.q_len, groups).reshape(1, kv, width, 1)
        flat = torch.softmax(torch.cat([flat, sink.expand(rows_, kv, width, 1)], dim=-1), dim=-1)[..., :-1]
    else:
        flat = torch.softmax(flat, dim=-1)
    probs = flat.reshape(rows_, kv, width, blocks, block_size).permute(0, 3, 1, 2, 4)
    by_entry = torch.zeros_like(scores)
    by_entry[dec.row_blocks] = probs  # each real entry belongs to one row
    if dec.pad_entry is not None:
        # A padding query (a row with fewer queries) has every key masked, so its softmax is
        # uniform, not zero, and it may land in the padding entry that other rows sum over.
        by_entry[dec.pad_entry] = 0
    by_entry = by_entry.to(v_pool.dtype)
    out = q.new_empty(span, kv, width, dim)
    start = 0
    for lo, hi in dec.segments:
        end = start + hi - lo
        torch.matmul(by_entry[start:end], v_ranges[lo:hi], out=out[start:end])
        start = end
    if dec.shared_blocks is not None:
        lane_probs = by_entry[span:].view(shared, lanes, kv, width, -1).transpose(1, 2)
        lane_out = torch.matmul(lane_probs.reshape(shared, kv, lanes * width, -1), v_shared)  # (S, kv, lanes*G, d)
        lane_out = lane_out.view(shared, kv, lanes, width, dim).transpose(1, 2).reshape(-1, kv, width, dim)
        out = torch.cat([out, lane_out])
    return out[dec.row_blocks].sum(dim=1)  # (rows, kv, G, d)


def _static_decode(dec: StaticDecode, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   scale: float, softcap: float | None, window: int | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """query ``(1, heads, rows, d)`` -> ``(1, rows, heads, d)``, eager semantics as the block-major path.

    Each row's blocks (``width`` of them: a fixed shape, the padding masked) are scored where they lie,
    softmaxed over all of them, and their values gathered for one product, so the kernels do not
    depend on the rows' lengths: no host sync, no branch on values.
    """
    rows, width = dec.block_tables.shape
    _, kv_heads, block_size, head_dim = k_pool.shape
    heads = query.shape[1]
    groups = heads // kv_heads
    q = query.transpose(1, 2).reshape(rows, 1, kv_heads, groups, head_dim)
    if q.dtype != k_pool.dtype:
        q = q.to(k_pool.dtype)
    keys = k_pool[dec.block_tables]  # (rows, width, kv, bs, d): a view per block, no copy of the pool
    scores = torch.matmul(q, keys.transpose(-1, -2))  # (rows, width, kv, g, bs)
    if scores.dtype != torch.float32:
        scores = scores.float()
    scores.mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = (scores + dec.mask(window, block_size)).permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, groups, -1)
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, groups, 1).expand(rows, kv_heads, groups, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if probs.dtype != v_pool.dtype:
        probs = probs.to(v_pool.dtype)
    # One product over all of a row's keys, rounded once as eager attention's is (block by block,
    # a bfloat16 sum of per-block outputs would round at every block).
    values = v_pool[dec.block_tables].permute(0, 2, 1, 3, 4).reshape(rows, kv_heads, width * block_size, head_dim)
    out = torch.matmul(probs, values)  # (rows, kv, g, d)
    return out.view(1, rows, heads, head_dim) if out.dtype == query.dtype else out.view(1, rows, heads, head_dim).to(
        query.dtype)


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
    if packed_step.static is not None:  # traced or captured: no bookkeeping on the host
        return _fixed_shape_step(module, query, key, value, packed_step, scaling, sliding_window, softcap, s_aux), None
    packed_step.seen_kwargs.update(n for n, v in (("sliding_window", sliding_window), ("softcap", softcap),
                                                  ("s_aux", s_aux)) if v is not None)
    window = _window(sliding_window)
    layer = module.layer_idx
    packed_step.layers_called.add(layer)
    cache = packed_step.cache
    k_pool, v_pool = cache.keys[layer], cache.values[layer]
    head_dim = query.shape[3]
    if key.shape[1] != k_pool.shape[1]:
        raise UnsupportedAttention(
            f"layer {layer} gives {key.shape[1]} KV heads where the cache holds {k_pool.shape[1]} per rank: the model's "
            "tensor-parallel plan does not split its key/value heads across ranks (use tensor_parallel_size 1)")
    if packed_step.native_writes and key.dtype == value.dtype == k_pool.dtype:
        native_write_kv(key[0], value[0], k_pool, v_pool, packed_step.write_slots)
    else:
        for pool, new in ((k_pool, key), (v_pool, value)):
            rows = new[0].transpose(0, 1).reshape(-1, head_dim).to(pool.dtype)  # (N * kv_heads, d), token-major
            pool.view(-1, head_dim).index_copy_(0, packed_step.write_slots, rows)

    heads, n_tokens = query.shape[1], query.shape[2]
    kv_heads = k_pool.shape[1]
    groups_per_kv = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    out = query.new_empty(n_tokens, heads, head_dim)
    q_all = query[0].transpose(0, 1)  # (N, heads, head_dim)
    if packed_step.native is not None:
        native = packed_step.native
        native_paged_decode(q_all, out, k_pool, v_pool, native.block_tables, native.token_index, native.query_pos,
                            scale, softcap, window, s_aux, indices_checked=True)  # by ModelRunner, once per step
    for dec in packed_step.block_major:
        rows = dec.token_index.shape[0]
        q = q_all[dec.token_index].view(rows, dec.q_len, kv_heads, groups_per_kv, head_dim)
        q = q.transpose(1, 2).reshape(rows, kv_heads, dec.q_len * groups_per_kv, head_dim)
        attn = _block_major_decode(dec, q, k_pool, v_pool, dec.mask(window), scale, softcap, s_aux)
        attn = attn.view(rows, kv_heads, dec.q_len, groups_per_kv, head_dim).transpose(1, 2)
        out[dec.tokens] = attn.reshape(-1, heads, head_dim)[dec.valid_flat].to(out.dtype)
    for group in packed_step.groups:
        flat = _group_attention(group, q_all, k_pool, v_pool, cache, packed_step.flex, scale, softcap, window, s_aux)
        out[group.tokens] = flat[group.valid_flat].to(out.dtype)
    return out.unsqueeze(0), None  # (1, N, heads, head_dim)


def _fixed_shape_step(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      packed_step: PackedStep, scaling: float | None, sliding_window: int | None,
                      softcap: float | None, s_aux: torch.Tensor | None) -> torch.Tensor:
    """A decode step traced or captured at a fixed shape (``workers.model.static_decode``): the new keys written
    to their slots, then one query per row against its blocks, with no host bookkeeping."""
    k_pool, v_pool = packed_step.cache.keys[module.layer_idx], packed_step.cache.values[module.layer_idx]
    head_dim = query.shape[3]
    for flat_pool, new in ((packed_step.cache.flat_keys[module.layer_idx], key),
                           (packed_step.cache.flat_values[module.layer_idx], value)):
        rows = new.reshape(-1, head_dim)  # head-major: (kv_heads * N, d), as the static write slots
        flat_pool.index_copy_(0, packed_step.write_slots, rows if rows.dtype == flat_pool.dtype
                              else rows.to(flat_pool.dtype))
    scale = scaling if scaling is not None else head_dim**-0.5
    static = packed_step.static
    if static.flex is not None:  # (1, heads, rows, d) as rows of one query each
        out = flex_paged_attention(query[0].transpose(0, 1).unsqueeze(2), k_pool, v_pool, static.flex, scale,
                                   softcap, _window(sliding_window), s_aux)
        return out.squeeze(2).unsqueeze(0)
    if static.native:
        rows = query.shape[2]
        out = native_paged_decode_op(query[0].transpose(0, 1).contiguous(), k_pool, v_pool, static.block_tables,
                                     torch.arange(rows, device=query.device).view(rows, 1),
                                     static.positions.view(rows, 1), scale, softcap, _window(sliding_window), s_aux)
        return out.unsqueeze(0)
    out = _static_decode(static, query, k_pool, v_pool, scale, softcap, _window(sliding_window), s_aux)
    return out


def _group_attention(group: AttentionGroup, q_all: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     cache: PagedKVCache, flex: bool, scale: float, softcap: float | None, window: int | None,
                     s_aux: torch.Tensor | None) -> torch.Tensor:
    """One group's attention (rows of a few queries each, padded to one key length): (rows * q, heads, d)."""
    kv_heads, head_dim, heads = k_pool.shape[1], q_all.shape[2], q_all.shape[1]
    groups_per_kv = heads // kv_heads
    # (rows * blocks, kv, bs, d) -> (kv, rows, L, d): one block-wise gather per group and layer.
    block_size = cache.block_size
    rows, blocks = group.rows, group.key_len // block_size

    def gather(pool: torch.Tensor) -> torch.Tensor:
        picked = pool.index_select(0, group.block_index).view(rows, blocks, kv_heads, block_size, head_dim)
        return picked.permute(2, 0, 1, 3, 4).reshape(kv_heads, rows, group.key_len, head_dim)

    if flex:  # every row's keys read where they lie
        q = q_all[group.token_index].transpose(1, 2)  # (rows, heads, q, d)
        attn = flex_paged_attention(q, k_pool, v_pool, group.flex_layout(cache, kv_heads, heads), scale,
                                    softcap, window, s_aux)
        return attn.transpose(1, 2).reshape(-1, heads, head_dim)
    k, v = gather(k_pool), gather(v_pool)
    q = q_all[group.token_index]  # (rows, q, heads, d)
    allowed, additive = group.masks(window)
    if softcap is None and s_aux is None and group.q_len > 1:
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2).to(k.dtype), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed.unsqueeze(1),
            scale=scale, enable_gqa=True,
        )  # (rows, heads, q, d)
        return attn.transpose(1, 2).reshape(-1, heads, head_dim)
    q = q.view(group.rows, group.q_len, kv_heads, groups_per_kv, head_dim).permute(2, 0, 3, 1, 4)
    attn = _manual_attention(q, k, v, additive, scale, softcap, s_aux)  # (kv, rows, g, q, d)
    return attn.permute(1, 3, 0, 2, 4).reshape(-1, heads, head_dim)


def register_paged_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)

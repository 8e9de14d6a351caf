"""Continuous-batching forward passes over a Hugging Face causal LM with a paged KV cache.

One forward per step for all of a worker's rows: every new token of the step
(decode tokens, prefill chunks, draft tokens) is packed into one sequence
``[1, N]`` with its own position and its cache slot, given by the row's block
table (decided by the coordinator). Projections and MLPs see only real
tokens; attention (``workers.paged_attention``) reads each row's blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workers.cpu_linear import prepack_available, prepack_linears
from workers.model_support import check_model_config, verify_against_eager
from workers.paged_attention import (
    ATTENTION_NAME,
    SHORT_QUERY_LIMIT,
    AttentionGroup,
    BlockMajorDecode,
    PackedStep,
    PagedKVCache,
    UnsupportedAttention,
    register_paged_attention,
)

logger = logging.getLogger(__name__)

MASK_LIMIT = 1 << 22  # rows x queries x keys of one padded prefill group (a 4 MiB boolean mask)


@dataclass
class RowWork:
    """One row's work this step: feed ``token_ids`` at positions ``start_pos..``; logits for the last ``num_logits``.

    ``block_table`` must cover every position up to ``start_pos + len(token_ids)``.
    """

    block_table: list[int]
    token_ids: list[int]
    start_pos: int
    num_logits: int = 1


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}") from None


def default_block_size(device: torch.device) -> int:
    return 16 if device.type == "cuda" else 64


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim


class ModelRunner:
    """Holds one model replica and its paged KV cache; runs packed forward passes."""

    def __init__(self, model_path: str | Path, device: torch.device | str, dtype: str = "auto",
                 max_model_len: int | None = None, trust_remote_code: bool = False,
                 prepack_cpu_weights: bool = True, block_size: int | None = None,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_rows: int = 64, verify: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        register_paged_attention()
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=self.dtype, trust_remote_code=trust_remote_code
        )
        config = model.config
        limit = getattr(config, "max_position_embeddings", None) or max_model_len
        self.max_model_len = min(max_model_len or limit, limit)
        check_model_config(config, self.max_model_len)
        try:
            model.set_attn_implementation(ATTENTION_NAME)
        except Exception as exc:
            raise UnsupportedAttention(
                f"{type(model).__name__} does not accept a custom attention function ({exc})"
            ) from None
        self.model = model.to(self.device).eval()
        self.vocab_size = config.vocab_size
        self.block_size = block_size or default_block_size(self.device)
        layers, kv_heads, head_dim = kv_geometry(config)
        block_size = self.block_size
        per_block = PagedKVCache.bytes_per_block(layers, block_size, kv_heads, head_dim, self.dtype)
        min_blocks = -(-self.max_model_len // block_size)  # one sequence of max_model_len
        self.num_blocks = self._num_blocks(per_block, kv_cache_memory, gpu_memory_utilization, max_rows * min_blocks)
        if self.num_blocks < min_blocks:
            raise ValueError(
                f"KV cache budget holds {self.num_blocks} blocks of {block_size} tokens "
                f"({per_block} bytes each); one sequence of max_model_len={self.max_model_len} needs {min_blocks}. "
                "Raise cache.kv_cache_memory / cache.gpu_memory_utilization or lower model.max_model_len."
            )
        self.last_step: PackedStep | None = None
        self.cache = PagedKVCache(layers, self.num_blocks, block_size, kv_heads, head_dim, self.dtype, self.device)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB) on %s", self.num_blocks, block_size,
                    self.num_blocks * per_block / 2**20, self.device)
        if verify:
            verify_against_eager(self)
        # After the check: prepacked linears are exact to rounding, and the check compares attention.
        if prepack_cpu_weights and prepack_available(self.device, self.dtype):
            prepack_linears(self.model)

    def _num_blocks(self, per_block: int, kv_cache_memory: int | None, utilization: float, every_row_full: int) -> int:
        if kv_cache_memory is not None:
            return kv_cache_memory // per_block
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * utilization) - (total - free)
            return max(budget, 0) // per_block
        return every_row_full  # CPU without a budget: as much as every row at max_model_len

    # ----- packing -----

    def _pack(self, rows: list[RowWork]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PackedStep]:
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        keep: list[int] = []
        spans: list[tuple[int, int, int]] = []  # (row index, offset in packed sequence, length)
        bs = self.block_size
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            end = row.start_pos + n
            if n == 0 or row.num_logits < 1 or row.num_logits > n:
                raise ValueError(f"row {i}: {n} tokens cannot give {row.num_logits} logits")
            if end > self.max_model_len:
                raise ValueError(f"row {i} reaches position {end}, beyond max_model_len={self.max_model_len}")
            if end > len(row.block_table) * bs:
                raise ValueError(f"row {i} reaches position {end}; its {len(row.block_table)} blocks hold {len(row.block_table) * bs}")
            spans.append((i, len(ids), n))
            ids.extend(row.token_ids)
            for pos in range(row.start_pos, end):
                positions.append(pos)
                blocks.append(row.block_table[pos // bs])
                offsets.append(pos % bs)
            keep.extend(range(len(ids) - row.num_logits, len(ids)))
        device = self.device
        pos_t = torch.tensor(positions, dtype=torch.long)
        single = [s for s in spans if s[2] == 1]
        short = [s for s in spans if 1 < s[2] <= SHORT_QUERY_LIMIT]
        block_major = [self._block_major(rows, members, positions) for members in (single, short) if members]
        groups: list[AttentionGroup] = []
        groups += [self._group(rows, members, pos_t) for members in self._batches(rows, spans)]
        step = PackedStep(
            cache=self.cache,
            write_block=torch.tensor(blocks, dtype=torch.long, device=device),
            write_offset=torch.tensor(offsets, dtype=torch.long, device=device),
            groups=groups,
            block_major=block_major,
        )
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        return input_ids, pos_t.unsqueeze(0).to(device), torch.tensor(keep, dtype=torch.long, device=device), step

    def _block_major(self, rows: list[RowWork], members: list[tuple[int, int, int]],
                     positions: list[int]) -> BlockMajorDecode:
        """Block-major decode attention metadata.

        Blocks read by one row are used in place when they lie densely in their range, else
        copied next to each other once; blocks read by several rows (a shared prefix, n > 1
        siblings) are copied once and met by every reader's query in one batched product.
        """
        bs = self.block_size
        tables = [rows[i].block_table[: (rows[i].start_pos + n - 1) // bs + 1] for i, _, n in members]
        num_rows = len(tables)
        counts = np.fromiter((len(t) for t in tables), dtype=np.int64, count=num_rows)
        used = np.fromiter((b for t in tables for b in t), dtype=np.int64, count=int(counts.sum()))
        pair_row = np.repeat(np.arange(num_rows), counts)
        pair_index = np.concatenate([np.arange(c) for c in counts])  # j: the block's place in its row
        q_len = max(n for _, _, n in members)
        token_index = np.zeros((num_rows, q_len), dtype=np.int64)
        query = np.full((num_rows, q_len), -1, dtype=np.int64)  # padding queries attend nothing
        for r, (_, offset, n) in enumerate(members):
            token_index[r, :n] = np.arange(offset, offset + n)
            query[r, :n] = positions[offset : offset + n]
        valid = (query >= 0).reshape(-1)
        distinct, inverse, users = np.unique(used, return_inverse=True, return_counts=True)
        shared_pair = users[inverse] > 1
        width = int(counts.max())

        # Blocks read by one row: entries 0..span-1, in place or compact.
        own = used[~shared_pair]
        gather = None
        if own.size == 0:
            lo = hi = 0
        else:
            lo, hi = int(own.min()), int(own.max()) + 1
            if hi - lo > 3 * own.size:
                gather, lo, hi = own, 0, own.size
        local = own - lo if gather is None else np.arange(own.size)
        shared = distinct[users > 1]
        lanes = int(users.max()) + 1 if shared.size else 0  # one spare lane: a masked entry for padding
        pad_entry = None
        if shared.size:
            pad_entry = (hi - lo) + lanes - 1
        else:
            owned = np.zeros(hi - lo, dtype=bool)
            owned[local] = True
            if not owned.all():
                pad_entry = int(np.flatnonzero(~owned)[0])
            elif width == int(counts.min()):
                pad_entry = 0  # no padding needed
            elif gather is None and hi < self.num_blocks:
                hi += 1
                pad_entry = hi - lo - 1
            else:  # every entry is real: append a copy of one block, masked, for the padding
                gather = np.append(own if gather is not None else np.arange(lo, hi), own[0])
                lo, hi = 0, gather.size
                pad_entry = hi - 1
        span = hi - lo
        entries = span + shared.size * lanes
        entry_of_pair = np.empty(used.size, dtype=np.int64)
        entry_of_pair[~shared_pair] = local
        lane_rows = None
        if shared.size:
            shared_index = np.searchsorted(shared, used[shared_pair])
            order = np.argsort(shared_index, kind="stable")
            sorted_index = shared_index[order]
            first = np.searchsorted(sorted_index, sorted_index)  # start of each block's run
            lane = np.empty_like(shared_index)
            lane[order] = np.arange(sorted_index.size) - first
            entry_of_pair[shared_pair] = span + shared_index * lanes + lane
            lane_rows = np.full((shared.size, lanes), num_rows, dtype=np.int64)
            lane_rows[shared_index, lane] = pair_row[shared_pair]
        row_of_block = np.zeros(span, dtype=np.int64)
        row_of_block[local] = pair_row[~shared_pair]
        key_pos = np.full((entries, bs), -1, dtype=np.int64)
        key_pos[entry_of_pair] = pair_index[:, None] * bs + np.arange(bs)
        query_pos = np.full((entries, q_len), -1, dtype=np.int64)
        query_pos[entry_of_pair] = query[pair_row]
        row_blocks = np.full((num_rows, width), pad_entry if pad_entry is not None else 0, dtype=np.int64)
        row_blocks[pair_row, pair_index] = entry_of_pair
        device = self.device

        def tensor(array: np.ndarray | None) -> torch.Tensor | None:
            return None if array is None else torch.from_numpy(np.ascontiguousarray(array)).to(device)

        return BlockMajorDecode(
            lo=lo, hi=hi, gather=tensor(gather),
            q_len=q_len, token_index=tensor(token_index), tokens=tensor(token_index.reshape(-1)[valid]),
            valid_flat=tensor(np.flatnonzero(valid)),
            row_of_block=tensor(row_of_block), row_blocks=tensor(row_blocks),
            key_pos=tensor(key_pos), query_pos=tensor(query_pos),
            shared_blocks=tensor(shared) if shared.size else None, lane_rows=tensor(lane_rows),
        )

    def _batches(self, rows: list[RowWork], spans: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
        """Long rows (prefill chunks) in padded batches whose mask stays under ``MASK_LIMIT`` entries."""
        batches: list[list[tuple[int, int, int]]] = []
        current: list[tuple[int, int, int]] = []
        queries = keys = 0
        for span in sorted((s for s in spans if s[2] > SHORT_QUERY_LIMIT), key=lambda s: s[2]):
            q, k = max(queries, span[2]), max(keys, rows[span[0]].start_pos + span[2])
            if current and (len(current) + 1) * q * k > MASK_LIMIT:
                batches.append(current)
                current, q, k = [], span[2], rows[span[0]].start_pos + span[2]
            current.append(span)
            queries, keys = q, k
        return batches + ([current] if current else [])

    def _group(self, rows: list[RowWork], members: list[tuple[int, int, int]], pos_t: torch.Tensor) -> AttentionGroup:
        q_len = max(n for _, _, n in members)
        index = torch.zeros(len(members), q_len, dtype=torch.long)
        valid = torch.zeros(len(members), q_len, dtype=torch.bool)
        for r, (_, offset, n) in enumerate(members):
            index[r, :n] = torch.arange(offset, offset + n)
            valid[r, :n] = True
        query_pos = pos_t[index].masked_fill(~valid, -1)
        # Each row's blocks up to its last query, padded with block 0 (masked by position).
        needed = [(rows[i].start_pos + n - 1) // self.block_size + 1 for i, _, n in members]
        per_row = max(needed)
        table = torch.zeros(len(members), per_row, dtype=torch.long)
        for r, ((i, _, _), count) in enumerate(zip(members, needed)):
            table[r, :count] = torch.tensor(rows[i].block_table[:count], dtype=torch.long)
        device = self.device
        return AttentionGroup(
            q_len=q_len,
            tokens=index[valid].to(device),
            token_index=index.to(device),
            valid_flat=valid.flatten().nonzero(as_tuple=True)[0].to(device),
            query_pos=query_pos.to(device),
            block_index=table.flatten().to(device),
            rows=len(members),
            key_len=per_row * self.block_size,
        )

    @torch.inference_mode()
    def forward(self, rows: list[RowWork]) -> torch.Tensor:
        """Logits ``[sum(num_logits), vocab]`` as float32, rows in the given order."""
        if not rows:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        input_ids, position_ids, keep, step = self._pack(rows)
        self.last_step = step  # inspected by the load-time check
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            packed_step=step,
        )
        return out.logits[0].to(torch.float32)

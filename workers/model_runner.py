"""Continuous-batching forward passes over a Hugging Face causal LM.

One forward per step for all of a worker's rows: every new token of the step
(decode tokens, prefill chunks, draft tokens) is packed into one sequence
``[1, N]`` with its own position. A custom attention function, registered with
transformers' ``AttentionInterface``, writes each token's K/V into a per-layer
slot cache ``[slots, kv_heads, max_len, head_dim]`` and attends per row, masking
by absolute position (so stale K/V of a reused slot is never seen). Projections
and MLPs therefore see only real tokens; only attention is padded, and only
among rows of the same kind (single-token rows vs multi-token rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from workers.cpu_linear import prepack_available, prepack_linears

ATTENTION_NAME = "raysample_packed"


@dataclass
class RowWork:
    """One row's work this step: feed ``token_ids`` at positions ``start_pos..``; logits for the last ``num_logits``."""

    slot: int
    token_ids: list[int]
    start_pos: int
    num_logits: int = 1


class SlotKVCache:
    """Preallocated K/V per layer: ``[slots, kv_heads, max_len, head_dim]``."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len


@dataclass
class _AttentionGroup:
    """Rows attended together. Single-token rows run either slot-major (every cache
    slot is a batch entry and the cache is used in place, no gather) or on the
    gathered slots of their rows; multi-token rows are padded to the longest."""

    kind: str  # "slot_major" | "gather_single" | "multi"
    tokens: torch.Tensor  # (n_valid,) packed-sequence indices, row-major
    slots: torch.Tensor  # (rows,)
    key_len: int
    mask: torch.Tensor  # (batch, 1, q, key_len): bool, True = attend (multi); additive float (single)
    token_index: torch.Tensor | None = None  # multi: (rows, q) padded with 0
    valid_flat: torch.Tensor | None = None  # multi: (n_valid,) positions in rows * q


@dataclass
class _PackedStep:
    cache: SlotKVCache
    write_slot: torch.Tensor  # (N,)
    write_pos: torch.Tensor  # (N,)
    groups: list[_AttentionGroup]


def _single_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """(batch, kv_heads, groups, head_dim) queries against (batch, kv_heads, key_len, head_dim).

    Two batched matmuls with an additive mask: at one query per row this reads
    K/V once and beats SDPA's CPU kernel, which is built for long queries.
    """
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q.to(k.dtype), k.transpose(-1, -2)).float().mul_(scale).add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)  # (batch, kv_heads, groups, head_dim)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, heads, N, head_dim), RoPE applied
    key: torch.Tensor,  # (1, kv_heads, N, head_dim), new tokens only
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_step: _PackedStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if packed_step is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs the packed_step argument (use ModelRunner)")
    layer = module.layer_idx
    k_cache, v_cache = packed_step.cache.keys[layer], packed_step.cache.values[layer]
    k_cache[packed_step.write_slot, :, packed_step.write_pos] = key[0].transpose(0, 1).to(k_cache.dtype)
    v_cache[packed_step.write_slot, :, packed_step.write_pos] = value[0].transpose(0, 1).to(v_cache.dtype)

    heads, n_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = k_cache.shape[1]
    groups_per_kv = heads // kv_heads
    out = query.new_empty(n_tokens, heads, head_dim)
    q_all = query[0].transpose(0, 1)  # (N, heads, head_dim)
    for group in packed_step.groups:
        rows = group.slots.numel()
        if group.kind == "multi":
            q = q_all[group.token_index].transpose(1, 2)  # (rows, heads, q, head_dim)
            k = k_cache[group.slots, :, : group.key_len].to(q.dtype)  # (rows, kv_heads, key_len, head_dim)
            v = v_cache[group.slots, :, : group.key_len].to(q.dtype)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=True)
            out[group.tokens] = attn.transpose(1, 2).reshape(-1, heads, head_dim)[group.valid_flat]
            continue
        # One query per row: grouped heads share their kv head, (rows, kv_heads, groups, head_dim).
        q = q_all[group.tokens].view(rows, kv_heads, groups_per_kv, head_dim)
        if group.kind == "slot_major":
            q_slots = q.new_zeros(k_cache.shape[0], kv_heads, groups_per_kv, head_dim)
            q_slots[group.slots] = q
            k = k_cache[:, :, : group.key_len]  # a view: no copy of the cache
            v = v_cache[:, :, : group.key_len]
            attn = _single_query_attention(q_slots, k, v, group.mask, scaling)[group.slots]
        else:
            k = k_cache[group.slots, :, : group.key_len]
            v = v_cache[group.slots, :, : group.key_len]
            attn = _single_query_attention(q, k, v, group.mask, scaling)
        out[group.tokens] = attn.reshape(rows, heads, head_dim).to(out.dtype)
    return out.unsqueeze(0), None  # (1, N, heads, head_dim)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}") from None


class ModelRunner:
    """Holds one model replica, its slot cache, and runs packed forward passes."""

    def __init__(self, model_path: str | Path, device: torch.device | str, dtype: str = "auto",
                 num_slots: int = 64, max_model_len: int | None = None, trust_remote_code: bool = False,
                 prepack_cpu_weights: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        _register_attention()
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=self.dtype, trust_remote_code=trust_remote_code
        )
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model.to(self.device).eval()
        if prepack_cpu_weights and prepack_available(self.device, self.dtype):
            prepack_linears(self.model)
        config = model.config
        limit = getattr(config, "max_position_embeddings", None) or max_model_len
        self.max_model_len = min(max_model_len or limit, limit)
        self.vocab_size = config.vocab_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.cache = SlotKVCache(
            config.num_hidden_layers, num_slots, kv_heads, self.max_model_len, head_dim, self.dtype, self.device
        )
        self.num_slots = num_slots

    def _pack(self, rows: list[RowWork]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _PackedStep]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        spans = []  # (row index, offset in packed sequence, length)
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            end = row.start_pos + n
            if n == 0 or row.num_logits < 1 or row.num_logits > n:
                raise ValueError(f"row {i}: {n} tokens cannot give {row.num_logits} logits")
            if end > self.cache.max_len:
                raise ValueError(f"row {i} reaches position {end}, beyond max_model_len={self.cache.max_len}")
            spans.append((i, len(ids), n))
            ids.extend(row.token_ids)
            positions.extend(range(row.start_pos, end))
            slots.extend([row.slot] * n)
            keep.extend(range(len(ids) - row.num_logits, len(ids)))
        device = self.device
        pos_t = torch.tensor(positions, dtype=torch.long)
        groups = [g for g in (self._single_group(rows, spans, pos_t), self._multi_group(rows, spans, pos_t)) if g]
        step = _PackedStep(
            cache=self.cache,
            write_slot=torch.tensor(slots, dtype=torch.long, device=device),
            write_pos=pos_t.to(device),
            groups=groups,
        )
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        return input_ids, pos_t.unsqueeze(0).to(device), torch.tensor(keep, dtype=torch.long, device=device), step

    def _single_group(self, rows: list[RowWork], spans: list, pos_t: torch.Tensor) -> _AttentionGroup | None:
        members = [(i, offset) for i, offset, n in spans if n == 1]
        if not members:
            return None
        tokens = torch.tensor([offset for _, offset in members], dtype=torch.long)
        slots = torch.tensor([rows[i].slot for i, _ in members], dtype=torch.long)
        query_pos = pos_t[tokens]
        key_len = int(query_pos.max()) + 1
        # Slot-major skips the K/V gather; worth it once most slots are busy.
        slot_major = 2 * len(members) >= self.num_slots
        if slot_major:
            limit = torch.full((self.num_slots,), -1, dtype=torch.long)
            limit[slots] = query_pos
        else:
            limit = query_pos
        allowed = (torch.arange(key_len).view(1, key_len) <= limit.view(-1, 1)).view(-1, 1, 1, key_len)
        mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))
        return _AttentionGroup(
            kind="slot_major" if slot_major else "gather_single",
            tokens=tokens.to(self.device),
            slots=slots.to(self.device),
            key_len=key_len,
            mask=mask.to(self.device),
        )

    def _multi_group(self, rows: list[RowWork], spans: list, pos_t: torch.Tensor) -> _AttentionGroup | None:
        members = [(i, offset, n) for i, offset, n in spans if n > 1]
        if not members:
            return None
        q = max(n for _, _, n in members)
        index = torch.zeros(len(members), q, dtype=torch.long)
        valid = torch.zeros(len(members), q, dtype=torch.bool)
        for r, (_, offset, n) in enumerate(members):
            index[r, :n] = torch.arange(offset, offset + n)
            valid[r, :n] = True
        query_pos = pos_t[index].masked_fill(~valid, -1)  # padding queries attend nothing
        key_len = int(query_pos.max()) + 1
        mask = (torch.arange(key_len).view(1, 1, key_len) <= query_pos.unsqueeze(-1)).unsqueeze(1)
        return _AttentionGroup(
            kind="multi",
            tokens=index[valid].to(self.device),
            slots=torch.tensor([rows[i].slot for i, _, _ in members], dtype=torch.long, device=self.device),
            key_len=key_len,
            mask=mask.to(self.device),
            token_index=index.to(self.device),
            valid_flat=valid.flatten().nonzero(as_tuple=True)[0].to(self.device),
        )

    @torch.inference_mode()
    def forward(self, rows: list[RowWork]) -> torch.Tensor:
        """Logits ``[sum(num_logits), vocab]`` as float32, rows in the given order."""
        if not rows:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        input_ids, position_ids, keep, step = self._pack(rows)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            packed_step=step,
        )
        return out.logits[0].to(torch.float32)

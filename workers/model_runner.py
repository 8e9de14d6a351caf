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
    token_index: torch.Tensor  # (rows, q) indices into the packed sequence (padded with 0)
    valid: torch.Tensor  # (rows, q) bool
    slots: torch.Tensor  # (rows,)
    key_len: int
    mask: torch.Tensor  # (rows, 1, q, key_len) bool, True = attend


@dataclass
class _PackedStep:
    cache: SlotKVCache
    write_slot: torch.Tensor  # (N,)
    write_pos: torch.Tensor  # (N,)
    groups: list[_AttentionGroup]


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
    out = query.new_empty(n_tokens, heads, head_dim)
    q_all = query[0].transpose(0, 1)  # (N, heads, head_dim)
    for group in packed_step.groups:
        q = q_all[group.token_index].transpose(1, 2)  # (rows, heads, q, head_dim)
        k = k_cache[group.slots, :, : group.key_len]  # (rows, kv_heads, key_len, head_dim)
        v = v_cache[group.slots, :, : group.key_len]
        attn = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=group.mask, scale=scaling, enable_gqa=True
        )  # (rows, heads, q, head_dim)
        attn = attn.transpose(1, 2)  # (rows, q, heads, head_dim)
        out[group.token_index[group.valid]] = attn[group.valid]
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
                 num_slots: int = 64, max_model_len: int | None = None, trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        _register_attention()
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=self.dtype, trust_remote_code=trust_remote_code
        )
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model.to(self.device).eval()
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
        groups = []
        for single in (True, False):
            members = [s for s in spans if (s[2] == 1) == single]
            if not members:
                continue
            q = max(n for _, _, n in members)
            index = torch.zeros(len(members), q, dtype=torch.long)
            valid = torch.zeros(len(members), q, dtype=torch.bool)
            for r, (_, offset, n) in enumerate(members):
                index[r, :n] = torch.arange(offset, offset + n)
                valid[r, :n] = True
            query_pos = pos_t[index].masked_fill(~valid, -1)  # padding queries attend nothing
            key_len = int(query_pos.max()) + 1
            mask = torch.arange(key_len).view(1, 1, key_len) <= query_pos.unsqueeze(-1)
            groups.append(
                _AttentionGroup(
                    token_index=index.to(device),
                    valid=valid.to(device),
                    slots=torch.tensor([rows[i].slot for i, _, _ in members], dtype=torch.long, device=device),
                    key_len=key_len,
                    mask=mask.unsqueeze(1).to(device),
                )
            )
        step = _PackedStep(
            cache=self.cache,
            write_slot=torch.tensor(slots, dtype=torch.long, device=device),
            write_pos=pos_t.to(device),
            groups=groups,
        )
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        return input_ids, pos_t.unsqueeze(0).to(device), torch.tensor(keep, dtype=torch.long, device=device), step

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

"""Shared test helpers: a reference model of the persistent batch and per-row references."""

from __future__ import annotations

import torch

from processors import BatchUpdate, EngineConfig, MoveDirectionality, SamplingParams

VOCAB = 32


def engine_config(max_num_seqs: int = 64) -> EngineConfig:
    return EngineConfig.simple(max_num_seqs)


def apply_update_to_rows(rows: list, update: BatchUpdate | None, payload_of_added) -> list:
    """Replay a BatchUpdate on a plain list (``None`` = empty row), the way the seed describes it."""
    if update is None:
        return rows
    rows = list(rows)
    for index in update.removed:
        rows[index] = None
    for index, params, prompt, output in update.added:
        while len(rows) <= index:
            rows.append(None)
        rows[index] = payload_of_added(params, prompt, output)
    for a, b, direction in update.moved:
        while len(rows) <= max(a, b):
            rows.append(None)
        if direction == MoveDirectionality.SWAP:
            rows[a], rows[b] = rows[b], rows[a]
        else:
            rows[b], rows[a] = rows[a], None
    del rows[update.batch_size :]
    return rows


def reference_min_p(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if not params.min_p:
        return row
    probs = torch.softmax(row, dim=-1)
    return row.masked_fill(probs < probs.max() * params.min_p, float("-inf"))


def reference_logit_bias(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    row = row.clone()
    for tok, bias in (params.logit_bias or {}).items():
        row[tok] += bias
    return row


def reference_min_tokens(row: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    row = row.clone()
    if len(output) < params.min_tokens:
        for tok in params.all_stop_token_ids:
            row[tok] = float("-inf")
    return row

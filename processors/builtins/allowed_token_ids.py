"""Restricts a row to ``SamplingParams.allowed_token_ids``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from processors.digest import dict_items_sorted, digest_of
from processors.interface import BatchUpdate
from processors.row_columns import upload
from processors.rowwise_processor import RowwiseLogitsProcessor
from processors.state import process_dict_updates


class AllowedTokenIdsLogitsProcessor(RowwiseLogitsProcessor):
    """Every token outside the allowed list goes to -inf (rows without a list are untouched)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.allowed: dict[int, tuple[int, ...]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.allowed,
            batch_update,
            lambda params, _, __: tuple(sorted(set(params.allowed_token_ids))) if params.allowed_token_ids else None,
        )

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        if not self.allowed:
            return logits
        local = [(i - rows.start, ids) for i, ids in self.allowed.items() if rows.start <= i < rows.stop]
        if not local:
            return logits
        row_ids = np.array([r for r, _ in local], dtype=np.int64)
        keep_rows = np.concatenate([np.full(len(ids), k, dtype=np.int64) for k, (_, ids) in enumerate(local)])
        keep_toks = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in local])
        # (n_rows_with_list, vocab) mask: True where the token must go.
        mask = torch.ones(len(local), logits.shape[1], dtype=torch.bool, device=logits.device)
        mask[upload(keep_rows, logits.device), upload(keep_toks, logits.device)] = False
        index = upload(row_ids, logits.device)
        logits[index] = logits[index].masked_fill_(mask, float("-inf"))
        return logits

    def state_digest(self) -> bytes:
        return digest_of("allowed_token_ids", dict_items_sorted(self.allowed))

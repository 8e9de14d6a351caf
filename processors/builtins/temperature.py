"""Temperature scaling; greedy rows (``is_greedy``) are left unscaled."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from processors.digest import digest_of
from processors.interface import BatchUpdate
from processors.row_columns import RowColumns, apply_on_rows, upload
from processors.rowwise_processor import RowwiseLogitsProcessor
from processors.sampling_params import is_greedy


class TemperatureLogitsProcessor(RowwiseLogitsProcessor):
    """Divides each random row by its temperature (a positive scale keeps the argmax)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows = RowColumns(vllm_config.scheduler_config.max_num_seqs, {"temperature": (np.float32, 1.0)})

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def values(params, _, __):
            t = params.temperature
            return None if is_greedy(t) or t == 1.0 else {"temperature": t}

        self.rows.update(batch_update, values)

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        temps = self.rows["temperature"][rows.start : rows.stop]
        local = np.flatnonzero(temps != 1.0)

        def scale(sub: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
            return sub.div_(upload(temps[idx], sub.device).unsqueeze(1))

        return apply_on_rows(logits, local, scale)

    def state_digest(self) -> bytes:
        return digest_of("temperature", self.rows["temperature"][: self.rows.batch_size].copy())

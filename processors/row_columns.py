"""Dense per-row columns that follow the BatchUpdate stream.

Several stages keep one value per persistent-batch row (a temperature, a
penalty, a seed). This keeps such columns in preallocated numpy arrays and
applies removes, adds and moves to all of them at once, so each stage only
says which values an added request brings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from processors.interface import BatchUpdate, MoveDirectionality
from processors.sampling_params import SamplingParams

ValuesOfAdded = Callable[[SamplingParams, "list[int] | None", "list[int]"], "dict[str, Any] | None"]


class RowColumns:
    """Named numpy columns of length ``max_rows``; a row off the stage holds the defaults."""

    def __init__(self, max_rows: int, columns: dict[str, tuple[Any, Any]]) -> None:
        self.defaults = {name: default for name, (_, default) in columns.items()}
        self.arrays: dict[str, np.ndarray] = {}
        for name, (dtype, default) in columns.items():
            array = np.empty(max_rows, dtype=dtype)
            array.fill(default)
            self.arrays[name] = array
        self.batch_size = 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def _reset(self, row: int) -> None:
        for name, array in self.arrays.items():
            array[row] = self.defaults[name]

    def update(self, batch_update: BatchUpdate | None, values_of_added: ValuesOfAdded) -> bool:
        """Apply removes, adds, moves; return whether any row's values changed."""
        if batch_update is None:
            return False
        for row in batch_update.removed:
            self._reset(row)
        for row, params, prompt, output in batch_update.added:
            values = values_of_added(params, prompt, output)
            self._reset(row)
            for name, value in (values or {}).items():
                self.arrays[name][row] = value
        for a, b, direction in batch_update.moved:
            for name, array in self.arrays.items():
                value_a = array[a]
                array[a] = array[b] if direction == MoveDirectionality.SWAP else self.defaults[name]
                array[b] = value_a
        self.batch_size = batch_update.batch_size
        return True


# Work on at most this many bytes of logits at once: temporaries stay in cache
# and below the allocator's mmap threshold (fresh large buffers cost page faults).
CHUNK_BYTES = 4 << 20


def rows_per_chunk(logits: torch.Tensor) -> int:
    return max(1, CHUNK_BYTES // max(1, logits.shape[1] * logits.element_size()))


def apply_on_rows(
    logits: torch.Tensor,
    local_rows: np.ndarray,
    fn: Callable[[torch.Tensor, np.ndarray], torch.Tensor],
) -> torch.Tensor:
    """Run ``fn(sub_logits, local_rows_of_sub)`` on some rows only, writing results back.

    Rows go through in cache-sized chunks (views when contiguous). Stages are
    row-wise, so a row's result does not depend on which rows share its chunk.
    """
    step = rows_per_chunk(logits)
    for start in range(0, local_rows.size, step):
        idx = local_rows[start : start + step]
        if idx[-1] - idx[0] + 1 == idx.size:
            view = logits[int(idx[0]) : int(idx[-1]) + 1]
            out = fn(view, idx)
            if out.data_ptr() != view.data_ptr():
                view.copy_(out)
        else:
            index = torch.from_numpy(idx).to(logits.device)
            logits.index_copy_(0, index, fn(logits.index_select(0, index), idx))
    return logits

"""Dense per-row columns that follow the BatchUpdate stream.

Several stages keep one value per persistent-batch row (a temperature, a
penalty, a seed). This keeps such columns in preallocated numpy arrays and
applies removes, adds and moves to all of them at once, so each stage only
says which values an added request brings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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

    def _reset(self, rows: list[int]) -> None:
        if rows:
            for name, array in self.arrays.items():
                array[rows] = self.defaults[name]

    def update(self, batch_update: BatchUpdate | None, values_of_added: ValuesOfAdded) -> bool:
        """Apply removes, adds, moves; return whether any row's values changed.

        Removes and adds go column by column, not row by row: a step that admits a wave of
        requests (a thousand rows on a 16-GPU engine) adds them all here, on every worker."""
        if batch_update is None:
            return False
        self._reset(list(batch_update.removed))
        added = batch_update.added
        rows = [row for row, *_ in added]
        if len(set(rows)) != len(rows):  # a row added twice in one update: the later add wins, as one by one
            for row, params, prompt, output in added:
                self._set([row], [values_of_added(params, prompt, output)])
        else:
            self._set(rows, [values_of_added(params, prompt, output) for _, params, prompt, output in added])
        self._move(batch_update.moved)
        self.batch_size = batch_update.batch_size
        return True

    def _move(self, moved: list[tuple[int, int, MoveDirectionality]]) -> None:
        """The moves, in order, as one gather per column: regrouping rows by worker after a wave
        moves hundreds of them."""
        if not moved:
            return
        source: dict[int, int] = {}  # row -> the row whose value it holds now; -1: the defaults
        for a, b, direction in moved:
            held_a, held_b = source.get(a, a), source.get(b, b)
            source[b] = held_a
            source[a] = held_b if direction == MoveDirectionality.SWAP else -1
        rows = list(source)
        sources = np.fromiter(source.values(), dtype=np.int64, count=len(rows))
        emptied = sources < 0
        for name, array in self.arrays.items():
            values = array[np.where(emptied, 0, sources)]
            values[emptied] = self.defaults[name]
            array[rows] = values

    def _set(self, rows: list[int], values: list[dict[str, Any] | None]) -> None:
        """Reset ``rows`` (distinct), then give each the values its added request brings."""
        self._reset(rows)
        names = list(values[0]) if values and values[0] else None
        if names is not None and all(row_values is not None and list(row_values) == names for row_values in values):
            # every row names the same columns (the usual case): one column at a time
            for name, column in zip(names, zip(*(row_values.values() for row_values in values))):
                self._assign(name, rows, column)
            return
        by_column: dict[str, tuple[list[int], list[Any]]] = {}
        for row, row_values in zip(rows, values):
            for name, value in (row_values or {}).items():
                column_rows, column_values = by_column.setdefault(name, ([], []))
                column_rows.append(row)
                column_values.append(value)
        for name, (column_rows, column_values) in by_column.items():
            self._assign(name, column_rows, column_values)

    def _assign(self, name: str, rows: list[int], values: Sequence[Any]) -> None:
        array = self.arrays[name]
        if array.dtype == object:  # a list value stays one element, not an axis
            values = np.fromiter(values, dtype=object, count=len(rows))
        array[rows] = values


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
            index = upload(idx, logits.device)
            logits.index_copy_(0, index, fn(logits.index_select(0, index), idx))
    return logits


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without making the host wait for the device: through pinned memory and a
    non-blocking copy on CUDA (a pageable copy there waits for the stream first), as it is elsewhere."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)

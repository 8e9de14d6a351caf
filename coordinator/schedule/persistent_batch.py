"""The persistent batch: which request sits in which row, and the BatchUpdate of each step.

Follows vLLM's model literally (seed "How the vLLM engine builds the
BatchUpdate data structure"): finished requests free their rows; new requests
refill the lowest freed rows in increasing order, then extend the batch at
max index + 1; freed rows left over are removed and the batch is condensed by
moving the highest occupied row into the lowest empty one; optional swaps
come last.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from processors import BatchUpdate, BatchUpdateBuilder, MoveDirectionality, SamplingParams


@dataclass
class BatchEntry:
    """One request as the batch (and every processor) sees it. Lists are live references."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int] | None
    output_token_ids: list[int]
    slot: int = -1  # the coordinator's slot for it (coordinator.schedule.slot_table), -1 when not tracked


class PersistentBatch:
    """Row layout of up to ``max_num_reqs`` requests; emits one ``BatchUpdate`` per step.

    Per step: ``update(finished, arrivals)`` at most once, then any number of
    ``swap``, then ``take_update()``.
    """

    def __init__(self, max_num_reqs: int) -> None:
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be at least 1, got {max_num_reqs}.")
        self.max_num_reqs = max_num_reqs
        self._slots: list[BatchEntry | None] = []
        self._row_of: dict[str, int] = {}
        self._builder = BatchUpdateBuilder()
        self._updated_this_step = False
        self._slot_of_row = np.full(max_num_reqs, -1, dtype=np.int64)

    # ----- reading -----

    @property
    def num_reqs(self) -> int:
        return len(self._row_of)

    def __len__(self) -> int:
        return self.num_reqs

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row_of

    def row_of(self, request_id: str) -> int:
        return self._row_of[request_id]

    def entry(self, row: int) -> BatchEntry:
        entry = self._slots[row] if 0 <= row < len(self._slots) else None
        if entry is None:
            raise IndexError(f"row {row} of the persistent batch is empty")
        return entry

    def entries(self) -> list[BatchEntry]:
        """Occupied rows in row order (the batch is contiguous between steps)."""
        return [e for e in self._slots if e is not None]

    def row_slots(self) -> np.ndarray:
        """Each row's slot, in row order (valid between steps, when the batch is contiguous)."""
        return self._slot_of_row[: self.num_reqs]

    def request_ids(self) -> list[str]:
        return [e.request_id for e in self.entries()]

    # ----- changing -----

    def update(self, finished: Iterable[str], arrivals: Sequence[BatchEntry]) -> list[int]:
        """Retire ``finished`` and place ``arrivals``; return each arrival's row at its add."""
        if self._updated_this_step:
            raise RuntimeError("PersistentBatch.update called twice in one step; call take_update() first.")
        finished = list(dict.fromkeys(finished))
        unknown = [rid for rid in finished if rid not in self._row_of]
        if unknown:
            raise KeyError(f"finished request(s) not in the batch: {unknown}")
        new_ids = [a.request_id for a in arrivals]
        clash = [rid for rid in new_ids if rid in self._row_of and rid not in finished]
        if clash or len(set(new_ids)) != len(new_ids):
            raise ValueError(f"request id(s) already in the batch or repeated: {clash or new_ids}")
        if self.num_reqs - len(finished) + len(arrivals) > self.max_num_reqs:
            raise ValueError(
                f"batch would hold {self.num_reqs - len(finished) + len(arrivals)} requests, "
                f"more than max_num_reqs={self.max_num_reqs}"
            )
        self._updated_this_step = True
        # 1. finished requests free their rows.
        for rid in finished:
            row = self._row_of.pop(rid)
            self._slots[row] = None
            self._builder.removed_append(row)
        # 2-4. refill the lowest freed rows, then extend at max index + 1.
        rows = []
        for arrival in arrivals:
            row = self._builder.pop_removed()
            if row is None:
                row = len(self._slots)
                self._slots.append(None)
            self._place(arrival, row)
            self._builder.added.append(
                (row, arrival.params, arrival.prompt_token_ids, arrival.output_token_ids)
            )
            rows.append(row)
        # 4.3 rows still free are removes: condense highest-occupied into lowest-empty.
        self._condense()
        return rows

    def _place(self, entry: BatchEntry, row: int) -> None:
        self._slots[row] = entry
        self._row_of[entry.request_id] = row
        self._slot_of_row[row] = entry.slot

    def _condense(self) -> None:
        empty_rows = sorted(self._builder.removed)  # ascending
        last = len(self._slots) - 1
        for empty in empty_rows:
            while last >= 0 and self._slots[last] is None:
                last -= 1
            if empty >= last:
                break
            entry = self._slots[last]
            assert entry is not None
            self._slots[last] = None
            self._place(entry, empty)
            self._builder.moved.append((last, empty, MoveDirectionality.UNIDIRECTIONAL))
            last -= 1
        while self._slots and self._slots[-1] is None:
            self._slots.pop()

    def swap(self, i: int, j: int) -> None:
        """Step 5: exchange two occupied rows (used to keep each worker's shard contiguous)."""
        if i == j:
            return
        a, b = self.entry(i), self.entry(j)
        self._place(a, j)
        self._place(b, i)
        self._builder.moved.append((i, j, MoveDirectionality.SWAP))
        self._builder.batch_changed = True

    def take_update(self) -> BatchUpdate | None:
        """This step's changes as a frozen ``BatchUpdate`` (``None`` if nothing changed)."""
        self._updated_this_step = False
        return self._builder.get_and_reset(self.num_reqs)


def group_by_owner(batch: PersistentBatch, owner_by_row: np.ndarray, num_workers: int) -> np.ndarray:
    """Swap rows so each worker's requests form one contiguous range, in worker order.

    Returns each worker's [start, stop) as a (workers, 2) array. Only rows outside their
    owner's range move, and each swap puts at least one row in place, so a step costs
    O(misplaced rows): when one worker's share grows and another's shrinks, about one row
    per boundary in between (keeping each worker's rows in their old order would shift
    every row between the two).
    """
    counts = np.bincount(owner_by_row, minlength=num_workers)[:num_workers]
    stops = np.cumsum(counts)
    target = np.repeat(np.arange(num_workers), counts)
    wrong = np.flatnonzero(owner_by_row != target)
    if wrong.size:
        owner = {row: int(owner_by_row[row]) for row in wrong.tolist()}
        holes: dict[int, list[int]] = {}  # worker -> misplaced rows inside its range
        for row in reversed(wrong.tolist()):
            holes.setdefault(int(target[row]), []).append(row)
        for row in wrong.tolist():
            while owner[row] != target[row]:
                hole = holes[owner[row]].pop()  # lowest first
                batch.swap(row, hole)
                owner[row], owner[hole] = owner[hole], owner[row]
    return np.stack([stops - counts, stops], axis=1)

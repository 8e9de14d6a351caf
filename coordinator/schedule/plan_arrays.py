"""Per-slot schedule data laid out as the plan's per-row arrays."""

from __future__ import annotations

import numpy as np

from coordinator.schedule.scheduler import StepSchedule
from workers.wire import EMPTY, offsets_of


def drafts_by_row(decision: StepSchedule, row_of_slot: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The step's drafts per row (layout after the update) and flat in row order."""
    rows = row_of_slot[decision.draft_slots]
    counts = decision.draft_counts
    order = np.argsort(rows, kind="stable")
    starts = offsets_of(counts)[:-1][order]
    c = counts[order]
    within = np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)
    per_row = np.zeros(batch_size, dtype=np.int32)
    per_row[rows] = counts
    return per_row, decision.draft_tokens[np.repeat(starts, c) + within].astype(np.int32)


def runs_by_row(runs: dict[int, list[int]], row_of_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-slot lists as (rows ascending, their lengths, the lists concatenated in row order)."""
    if not runs:
        return EMPTY, EMPTY, EMPTY
    pairs = sorted((int(row_of_slot[slot]), values) for slot, values in runs.items())
    rows = np.array([row for row, _ in pairs], dtype=np.int32)
    counts = np.array([len(values) for _, values in pairs], dtype=np.int32)
    flat = np.array([v for _, values in pairs for v in values], dtype=np.int32)
    return rows, counts, flat

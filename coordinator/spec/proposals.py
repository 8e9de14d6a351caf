"""A step's drafts: each row's n-gram proposals, bounded by what the row may still accept, then trimmed by the
draft policy (``speculative.draft_policy: adaptive``), which while nothing waits verifies only rows that pace
the batch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from coordinator.spec.draft_policy import CRITICAL_SHARE, DraftPolicy
from coordinator.spec.ngram_batch import BatchNgramDrafter
from workers.wire import offsets_of


def propose_drafts(drafter: BatchNgramDrafter, policy: DraftPolicy | None, slots: np.ndarray, lefts: np.ndarray,
                   budget: int, waiting: bool, request_ids: Callable[[], list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for rows ``slots`` (arrival order); ``lefts``: tokens each may still generate (max_tokens and
    max_model_len), so accepting every draft plus a bonus stays in bounds. Returns (drafts per slot, flat)."""
    rooms = np.minimum(lefts, budget + 1) - 1
    critical_only = policy is not None and not waiting
    if critical_only:  # DraftPolicy.critical_rows, on arrays
        critical = lefts >= CRITICAL_SHARE * lefts.max(initial=0)
        rooms = np.where(critical, rooms, 0)
    counts, flat = drafter.propose(slots, rooms)
    if critical_only and bool(((counts == 0) & critical).any()):
        return np.zeros(len(slots), np.int32), flat[:0]  # a critical row has nothing to verify: cannot pay
    if policy is None:
        return counts, flat
    offsets = offsets_of(counts).tolist()
    flat_list = flat.tolist()
    ids = request_ids()
    proposals = {rid: flat_list[offsets[i] : offsets[i + 1]] for i, rid in enumerate(ids) if counts[i]}
    chosen = policy.choose(proposals, len(slots))
    kept = [chosen.get(rid, []) for rid in ids]
    return (np.array([len(d) for d in kept], dtype=np.int32),
            np.array([t for d in kept for t in d], dtype=np.int32))

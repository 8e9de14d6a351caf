"""Building the per-step ``BatchUpdate`` and holding the loaded processors."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, TypeVar

from processors.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)

if TYPE_CHECKING:
    from processors.sampling_params import SamplingParams

T = TypeVar("T")


class BatchUpdateBuilder:
    """Collects one step's removes, adds and moves, then freezes them.

    Contract (enforced): every ``removed_append`` of a step happens before the
    removed list is first read (``removed``, ``peek_removed``, ``pop_removed``),
    because the first read sorts it descending so that popping the last element
    yields the lowest free slot.
    """

    def __init__(
        self,
        removed: list[RemovedRequest] | None = None,
        added: list[AddedRequest] | None = None,
        moved: list[MovedRequest] | None = None,
    ) -> None:
        self._removed: list[RemovedRequest] = removed or []
        self.added: list[AddedRequest] = added or []
        self.moved: list[MovedRequest] = moved or []
        self._is_removed_sorted = False
        # True once anything changed this step, even with no add recorded.
        self.batch_changed = False

    def _ensure_removed_sorted(self) -> None:
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True

    @property
    def removed(self) -> list[RemovedRequest]:
        """Removed indices, descending."""
        self._ensure_removed_sorted()
        return self._removed

    def removed_append(self, index: int) -> None:
        if self._is_removed_sorted:
            raise RuntimeError("Cannot register new removed request after self.removed has been read.")
        self._removed.append(index)
        self.batch_changed = True

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """Lowest removed index, left in place."""
        if not self._removed:
            return None
        self._ensure_removed_sorted()
        return self._removed[-1]

    def pop_removed(self) -> int | None:
        """Lowest removed index, taken out (it is being refilled by an add)."""
        if not self._removed:
            return None
        self._ensure_removed_sorted()
        return self._removed.pop()

    def reset(self) -> bool:
        """Drop everything collected; return whether the batch had changed."""
        self._is_removed_sorted = False
        self._removed.clear()
        self.added.clear()
        self.moved.clear()
        changed, self.batch_changed = self.batch_changed, False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """Freeze this step's changes (``None`` when there were none) and start afresh."""
        self._is_removed_sorted = False
        self.batch_changed = False
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(
            batch_size=batch_size,
            removed=self._removed,
            added=self.added,
            moved=self.moved,
        )
        # New lists: the frozen update keeps the old ones.
        self._removed, self.added, self.moved = [], [], []
        return update


class LogitsProcessors:
    """The loaded processors, split by argmax invariance as the sampler needs them."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs or ():
            bucket = self.argmax_invariant if proc.is_argmax_invariant() else self.non_argmax_invariant
            bucket.append(proc)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        return chain(self.argmax_invariant, self.non_argmax_invariant)

    def __len__(self) -> int:
        return len(self.argmax_invariant) + len(self.non_argmax_invariant)


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Apply a ``BatchUpdate`` to a sparse ``{row: state}`` dict.

    ``new_state`` maps an added request to its entry, or ``None`` when the
    processor is off for it. Returns whether the dict changed.
    """
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_tok_ids, output_tok_ids in batch_update.added:
        state = new_state(params, prompt_tok_ids, output_tok_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    if req_entries:
        for index in batch_update.removed:
            if req_entries.pop(index, None) is not None:
                updated = True
        for a_index, b_index, direction in batch_update.moved:
            a_entry = req_entries.pop(a_index, None)
            b_entry = req_entries.pop(b_index, None)
            if a_entry is not None:
                req_entries[b_index] = a_entry
                updated = True
            if b_entry is not None:
                updated = True
                if direction == MoveDirectionality.SWAP:
                    req_entries[a_index] = b_entry
    return updated

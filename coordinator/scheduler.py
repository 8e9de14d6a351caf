"""Admission (FCFS), owner choice (least-loaded worker) and shard ordering."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from coordinator.persistent_batch import PersistentBatch
from coordinator.request import Request


class Scheduler:
    def __init__(self, max_num_seqs: int, num_workers: int, slots_per_worker: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.slots_per_worker = slots_per_worker
        self.waiting: deque[Request] = deque()
        self.load = [0] * num_workers  # running requests per worker

    @property
    def num_workers(self) -> int:
        return len(self.load)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove_waiting(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return request
        return None

    def release(self, request: Request) -> None:
        if request.owner is not None:
            self.load[request.owner] -= 1
            request.owner = None

    def admit(self, running: int) -> list[Request]:
        """Take waiting requests in arrival order while total and per-worker room remain."""
        admitted = []
        while self.waiting and running + len(admitted) < self.max_num_seqs:
            owner = min(range(self.num_workers), key=lambda w: (self.load[w], w))
            if self.load[owner] >= self.slots_per_worker:
                break
            request = self.waiting.popleft()
            request.owner = owner
            self.load[owner] += 1
            admitted.append(request)
        return admitted

    def set_workers(self, alive: Iterable[int]) -> None:
        """Forget the load of workers that are gone (their requests are re-admitted)."""
        alive = set(alive)
        self.load = [load if w in alive else self.slots_per_worker for w, load in enumerate(self.load)]


def group_by_owner(batch: PersistentBatch, owner_of: dict[str, int], num_workers: int) -> list[tuple[int, int]]:
    """Swap rows so each worker's requests form one contiguous range (stable order within a worker).

    Returns each worker's (start, stop). Uses at most one swap per misplaced row.
    """
    ids = batch.request_ids()
    target = sorted(range(len(ids)), key=lambda r: (owner_of[ids[r]], r))
    wanted = [ids[r] for r in target]
    for row, rid in enumerate(wanted):
        current = batch.row_of(rid)
        if current != row:
            batch.swap(row, current)
    shards = []
    start = 0
    for w in range(num_workers):
        count = sum(1 for rid in ids if owner_of[rid] == w)
        shards.append((start, start + count))
        start += count
    return shards

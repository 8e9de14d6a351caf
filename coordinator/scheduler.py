"""Which requests run this step, how many tokens each, on which worker's blocks.

Per step, under a token budget (``max_num_batched_tokens``) and each worker's
block pool, in this order:

1. every running request gets one token (decode, or the next prefill token),
   in arrival order; when its owner has no free block, the newest running
   request of that owner is preempted (blocks freed, back to the queue front,
   recomputed later: exact thanks to counter-based sampling);
2. running prefills extend their chunk with what budget and free blocks allow;
3. decoding rows get their speculative drafts, as many as the draft policy finds
   worth verifying and fit;
4. waiting requests are admitted first come, first served, each with at least
   one token of budget, a row on the least loaded worker, and the blocks its
   first chunk needs after prefix-cache hits.

So decode rows are never starved by long prompts, and no step computes more
than the budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from coordinator.kv_blocks import KVCacheManager
from coordinator.persistent_batch import PersistentBatch
from coordinator.request import Request

# (rows that sample this step, token budget left) -> drafts by request id
DraftProposer = Callable[[list[Request], int], dict[str, list[int]]]


@dataclass
class StepSchedule:
    """What the scheduler decided for one step."""

    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens fed (drafts excluded)
    start: dict[str, int] = field(default_factory=dict)  # request id -> tokens already computed
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, max_num_seqs: int, num_workers: int, rows_per_worker: int, max_num_batched_tokens: int,
                 kv: KVCacheManager) -> None:
        self.max_num_seqs = max_num_seqs
        self.rows_per_worker = rows_per_worker
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.load = [0] * num_workers  # running requests per worker
        self.alive = set(range(num_workers))
        self.num_preemptions = 0

    @property
    def num_workers(self) -> int:
        return len(self.load)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove_waiting(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.drop_kv(request)
                return request
        return None

    def release(self, request: Request) -> None:
        """The request leaves its worker (finished, aborted, preempted): free its row and blocks."""
        self.drop_kv(request)
        if request.owner is not None:
            self.load[request.owner] -= 1
            request.owner = None

    def drop_kv(self, request: Request) -> None:
        if request.kv is not None and request.kv_owner is not None:
            self.kv.free(request.kv_owner, request.kv)
        request.kv = None
        request.kv_owner = None

    def set_workers(self, alive: Iterable[int]) -> None:
        """Only these workers take requests from now on; every pool is forgotten (all requests are re-admitted)."""
        self.alive = set(alive)
        self.kv.pools = [type(p)(p.num_blocks) for p in self.kv.pools]

    # ----- one step -----

    def schedule(self, running: list[Request], propose: DraftProposer | None) -> StepSchedule:
        """``running``: requests in the batch that stay (finished ones already released)."""
        out = StepSchedule()
        budget = self.max_num_batched_tokens
        running = sorted(running, key=lambda r: r.arrival_seq)
        active: list[Request] = []
        preempted_ids: set[str] = set()
        # 1. one token each, preempting the newest request of an owner that has no block left.
        for request in running:
            if request.request_id in preempted_ids:
                continue
            while not self._fits(request, request.kv.num_computed + 1):
                victim = next((r for r in reversed(running)
                               if r.owner == request.owner and r.request_id not in preempted_ids), None)
                self._preempt(victim, out)
                preempted_ids.add(victim.request_id)
                if victim is request:
                    break
            if request.request_id in preempted_ids:
                continue
            self._grow(request, out, 1)
            budget -= 1
            active.append(request)
        # 2. prefills extend their chunk.
        for request in active:
            remaining = request.num_tokens - request.kv.num_computed - out.num_tokens[request.request_id]
            if remaining > 0 and budget > 0:
                extra = self._affordable(request, min(remaining, budget), extra_after=out.num_tokens[request.request_id])
                if extra:
                    self._grow(request, out, extra)
                    budget -= extra
        # 3. drafts for rows that sample this step.
        if propose is not None:
            sampling = [request for request in active if self._samples(request, out)]
            proposals = propose(sampling, budget) if sampling else {}
            for request in sampling:
                if budget <= 0:
                    break
                drafts = proposals.get(request.request_id)
                if not drafts:
                    continue
                room = self._affordable(request, min(len(drafts), budget),
                                        extra_after=out.num_tokens[request.request_id])
                if room:
                    out.drafts[request.request_id] = drafts[:room]
                    total = request.kv.num_computed + out.num_tokens[request.request_id] + room
                    out.new_blocks[request.request_id] += self.kv.grow(request.owner, request.kv, total)
                    budget -= room
        # 4. admissions.
        rows = len(active)
        for request in list(self.waiting):
            if budget <= 0 or rows >= self.max_num_seqs:
                break
            if not request.constraint_ready():
                continue  # its grammar is still compiling: later requests go first
            if request.request_id in preempted_ids or not request.admissible():
                break
            owner = self._owner_for(request)
            if owner is None:
                break
            if request.kv is None or request.kv_owner != owner:
                self.drop_kv(request)
                request.kv = self.kv.start(owner, request.all_token_ids(), request.cache_salt(self.kv.prefix_caching))
                request.kv_owner = owner
            request.owner = owner
            chunk = self._affordable(request, min(request.num_tokens - request.kv.num_computed, budget))
            if chunk == 0:
                request.owner = None
                break  # no blocks: wait for running requests to finish
            self.waiting.remove(request)
            self.load[owner] += 1
            out.admitted.append(request)
            self._grow(request, out, chunk)
            out.new_blocks[request.request_id] = list(request.kv.block_table)  # the worker's table starts empty
            budget -= chunk
            rows += 1
        return out

    def _samples(self, request: Request, out: StepSchedule) -> bool:
        return request.kv.num_computed + out.num_tokens[request.request_id] == request.num_tokens

    def _fits(self, request: Request, total: int) -> bool:
        return self.kv.extra_blocks(request.kv, total) <= self.kv.pools[request.owner].num_free

    def _affordable(self, request: Request, want: int, extra_after: int = 0) -> int:
        """How many of ``want`` more tokens the owner's free blocks can hold."""
        base = request.kv.num_computed + extra_after
        room = (len(request.kv.block_table) + self.kv.pools[request.owner].num_free) * self.kv.block_size - base
        return max(0, min(want, room))

    def _grow(self, request: Request, out: StepSchedule, count: int) -> None:
        rid = request.request_id
        out.start.setdefault(rid, request.kv.num_computed)
        out.num_tokens[rid] = out.num_tokens.get(rid, 0) + count
        computed = request.kv.num_computed + out.num_tokens[rid]
        out.new_blocks.setdefault(rid, []).extend(self.kv.grow(request.owner, request.kv, computed))
        # Blocks filled by this step are shareable from now on: a later request of this same
        # step reads them after they are written, since every layer writes before it attends.
        self.kv.commit(request.owner, request.kv, request.all_token_ids(), computed,
                       request.cache_salt(self.kv.prefix_caching))

    def _preempt(self, request: Request, out: StepSchedule) -> None:
        rid = request.request_id
        if rid in out.num_tokens:  # cannot happen: victims are picked among unscheduled rows
            raise RuntimeError(f"preempting {rid} after scheduling it")
        self.release(request)
        request.preempt()
        out.preempted.append(request)
        self.num_preemptions += 1

    def requeue_front(self, requests: list[Request]) -> None:
        """Put requests back at the head of the queue, oldest first."""
        for request in sorted(requests, key=lambda r: r.arrival_seq, reverse=True):
            self.waiting.appendleft(request)

    def _owner_for(self, request: Request) -> int | None:
        """Pinned owner (n > 1 siblings) or the least loaded live worker with a free row."""
        candidates = [request.pinned_owner] if request.pinned_owner is not None else sorted(self.alive)
        candidates = [w for w in candidates if w in self.alive and self.load[w] < self.rows_per_worker]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (self.load[w], -self.kv.pools[w].num_free, w))


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

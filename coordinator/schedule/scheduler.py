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
   one token of budget, a row on the least loaded worker (or on the worker that
   holds its prefix, if not much busier), and the blocks its first chunk needs
   after prefix-cache hits: blocks cached, or being computed in this same step
   by a request admitted before it, so two requests that share an uncached
   prefix compute it once.

So decode rows are never starved by long prompts, and no step computes more
than the budget.

Per-row state lives in a ``SlotTable`` (arrays): a decode row that needs no new
block, publishes no full block and preempts nothing costs no Python; only rows
that change (prefills, a block boundary, drafts, admissions) run per-request
code, in arrival order, exactly as a loop over every row would. A step where an
owner runs short of blocks runs step 1 per request, which preempts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from coordinator.kv_blocks import KVCacheManager, chain_keys, extend_keys
from coordinator.request import Request
from coordinator.schedule.owner_choice import OwnerPicker
from coordinator.schedule.slot_table import SlotTable

# (slots that sample this step, in arrival order; token budget left) -> (drafts per slot, drafts flat)
DraftProposer = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


class TokenView(Sequence):
    """Prompt + output of a request without concatenating them (prefix keys read one block at a time)."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        if not isinstance(index, slice):
            p = len(self.prompt)
            index = index + len(self) if index < 0 else index
            return self.prompt[index] if index < p else self.output[index - p]
        start, stop, _ = index.indices(len(self))
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p : stop - p]
        if stop <= p:
            return self.prompt[start:stop]
        return self.prompt[start:] + self.output[: stop - p]


@dataclass
class StepSchedule:
    """What the scheduler decided for one step; per-row figures are indexed by slot."""

    start: np.ndarray  # tokens already computed when the step starts
    num_tokens: np.ndarray  # tokens fed this step (drafts excluded); 0: not scheduled
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    new_blocks: dict[int, list[int]] = field(default_factory=dict)
    # Drafts to verify: slots (arrival order), how many each, the drafts flat in that order.
    draft_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    draft_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    draft_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    scheduled: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # slots that run this step


def id_of(request: Request) -> int | None:
    """The request's LoRA adapter id, None for the base model."""
    lora = request.params._lora
    return None if lora is None else lora.lora_int_id


class Scheduler:
    def __init__(self, max_num_seqs: int, num_workers: int, rows_per_worker: int, max_num_batched_tokens: int,
                 kv: KVCacheManager, max_model_len: int = 1 << 30, admits: Callable[[Request], bool] | None = None,
                 on_release: Callable[[int], None] | None = None, step_multiple: int = 1,
                 prompt_logprob_chunk: int = 1 << 30, max_loras: int = 1 << 30) -> None:
        """``admits``: which waiting requests may be admitted now (the coordinator's quarantine; None: all);
        ``on_release``: told of each slot freed (``SlotTable``); ``step_multiple``: make a step's tokens a
        multiple of this where prompt tokens can fill it (``_aligned_budget``); ``prompt_logprob_chunk``: the most
        prompt tokens a step computes of a request that asks for prompt logprobs (each gives a row of logits
        over the vocabulary: a 4k-token prompt never holds 4k of them at once)."""
        self.step_multiple = step_multiple
        self.prompt_logprob_chunk = prompt_logprob_chunk
        self.max_loras = max_loras  # distinct LoRA adapters a step may hold (what a worker's device holds)
        self.max_num_seqs = max_num_seqs
        self.rows_per_worker = rows_per_worker
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.table = SlotTable(max_num_seqs, max_model_len, kv.block_size, on_release)
        self.waiting: deque[Request] = deque()
        self.load = [0] * num_workers  # running requests per worker
        self.alive = set(range(num_workers))
        self.num_preemptions = 0
        self.admits = admits
        self._held: list[Request] | None = None

    @property
    def num_workers(self) -> int:
        return len(self.load)

    def add(self, request: Request) -> None:
        if self._held is not None:
            self._held.append(request)
        else:
            self.waiting.append(request)

    def hold(self) -> None:
        """Keep the requests added from now on out of the queue until ``release_held`` (one submitted batch)."""
        self._held = []

    def release_held(self, order: Callable[[list[Request]], Sequence[int]] | None = None) -> None:
        """Queue the held requests, in ``order`` (indices into them) or as they came."""
        held, self._held = self._held or [], None
        indices = order(held) if order is not None and len(held) > 1 else range(len(held))
        self.waiting.extend(held[i] for i in indices)

    def remove_waiting(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.drop_kv(request)
                return request
        return None

    def release(self, request: Request) -> None:
        """The request leaves its worker (finished, aborted, preempted): free its row, slot and blocks."""
        if request.slot is not None:
            self.table.release(request.slot)
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

    def schedule(self, running: np.ndarray, propose: DraftProposer | None) -> StepSchedule:
        """``running``: slots of the requests in the batch that stay (finished ones already released). In order:
        one token each for the running rows, prefill chunks extended, drafts for the rows that sample, then
        admissions, each from the token budget the ones before left."""
        table = self.table
        out = StepSchedule(np.zeros(table.capacity, np.int64), np.zeros(table.capacity, np.int64))
        running = running[np.argsort(table.arrival[running], kind="stable")]  # arrival order
        active = self._running_rows(running, out)
        budget = self.max_num_batched_tokens - len(active)
        if self.step_multiple > 1:
            budget = self._aligned_budget(active, out, budget)
        budget = self._extend_prefills(active, out, budget)
        if propose is not None:
            samples = table.computed[active] + out.num_tokens[active] == table.total[active]
            sampling = active[samples]
            if sampling.size:
                counts, flat = propose(sampling, budget)
                budget -= self._take_drafts(sampling, counts, flat, budget, out)
        admitted = self._admit(active, out, budget)
        out.scheduled = np.concatenate([active, np.array(admitted, np.int64)])
        return out

    def _running_rows(self, running: np.ndarray, out: StepSchedule) -> np.ndarray:
        """One token each, preempting the newest request of an owner that has no block left; the rows that stay."""
        table = self.table
        computed = table.computed[running]
        needs_block = computed + 1 > table.cap[running]
        short = np.bincount(table.owner[running][needs_block], minlength=self.num_workers) > np.array(
            [pool.num_free for pool in self.kv.pools])
        if short.any():
            return self._one_token_each(running, out)
        out.start[running] = computed
        out.num_tokens[running] = 1
        commits = table.salted[running] & ((computed + 1) // self.kv.block_size > table.registered[running])
        prefill = computed + 1 < table.total[running]
        if self._no_eviction(table.owner[running][needs_block]):
            # Allocations take never-cached blocks only, so they cannot change the prefix
            # index that commits write: decode rows get their block in bulk (arrival order
            # within each owner, as one by one), the rest go one by one.
            decode = running[needs_block & ~prefill]
            self._grow_in_bulk(decode, np.ones(len(decode), dtype=np.int64), out)
            changing = prefill
            self._publish_filled(running[commits & ~prefill])
        else:
            changing = needs_block | commits | prefill
        for slot in running[changing].tolist():
            self._extend(table.requests[slot], out)
        return running

    def _extend_prefills(self, active: np.ndarray, out: StepSchedule, budget: int) -> int:
        """Prefills extend their chunk, in arrival order, within the budget; returns the budget left."""
        table = self.table
        remaining = table.total[active] - table.computed[active] - out.num_tokens[active]
        for slot in active[remaining > 0].tolist():
            if budget <= 0:
                break
            request = table.requests[slot]
            table.store(slot)
            want = min(int(table.total[slot] - table.computed[slot] - out.num_tokens[slot]), budget,
                       self._chunk_cap(request) - int(out.num_tokens[slot]))
            if want <= 0:
                continue
            extra = self._affordable(request, want, extra_after=int(out.num_tokens[slot]))
            if extra:
                out.num_tokens[slot] += extra
                self._extend(request, out)
                budget -= extra
        return budget

    def _admit(self, active: np.ndarray, out: StepSchedule, budget: int) -> list[int]:
        """Waiting requests admitted in order while the budget, the rows, the blocks and the adapters allow;
        their slots."""
        table = self.table
        rows, admitted = len(active), []
        preempted_ids = {r.request_id for r in out.preempted}
        picker = OwnerPicker(self) if self.waiting else None
        adapters = {id_of(table.requests[s]) for s in active.tolist()} - {None} if self.waiting else set()
        for request in list(self.waiting):
            if budget <= 0 or rows >= self.max_num_seqs:
                break
            if not request.constraint_ready():
                continue  # its grammar is still compiling: later requests go first
            if self.admits is not None and not self.admits(request):
                continue  # suspects of an engine failure run apart from everyone else
            if request.request_id in preempted_ids or not request.admissible():
                break
            adapter = id_of(request)
            if adapter is not None and adapter not in adapters and len(adapters) >= self.max_loras:
                continue  # its adapter would be one more than a worker holds: it waits for a step with room
            owner = self._place(request, picker)
            if owner is None:
                break
            chunk = self._affordable(request, min(request.num_tokens - request.kv.num_computed, budget,
                                                  self._chunk_cap(request)))
            if chunk == 0:
                request.owner = None
                break  # no blocks: wait for running requests to finish
            self.waiting.remove(request)
            self.load[owner] += 1
            out.admitted.append(request)
            if adapter is not None:
                adapters.add(adapter)
            slot = self.table.take(request, request.cache_salt(self.kv.prefix_caching) is not None)
            admitted.append(slot)
            out.start[slot] = request.kv.num_computed
            out.num_tokens[slot] = chunk
            self._extend(request, out)
            picker.touched(owner)
            out.new_blocks[slot] = list(request.kv.block_table)  # the worker's table starts empty
            budget -= chunk
            rows += 1
        return admitted

    def _place(self, request: Request, picker: OwnerPicker) -> int | None:
        """The worker an admitted request runs on (None: none can take it now), its KV started there."""
        salt = request.cache_salt(self.kv.prefix_caching)
        keys = None
        if request.pinned_owner is not None:
            owner = self._pinned_owner(request)
        else:
            if salt is not None and len(self.alive) > 1 and request.kv is None:
                keys = chain_keys(request.all_token_ids(), self.kv.block_size, salt)
            owner = picker.pick(keys)
        if owner is None:
            return None
        if request.kv is None or request.kv_owner != owner:
            held_by = request.kv_owner
            self.drop_kv(request)
            if held_by is not None:
                picker.touched(held_by)  # its blocks came free
            request.kv = self.kv.start(owner, request.all_token_ids(), salt, keys)
            request.kv_owner = owner
        request.owner = owner
        return owner

    def _chunk_cap(self, request: Request) -> int:
        """The most tokens a step computes of this request: bounded while its prompt gives logits."""
        if request.params.prompt_logprobs is None:
            return 1 << 30
        return self.prompt_logprob_chunk

    def _aligned_budget(self, active: np.ndarray, out: StepSchedule, budget: int) -> int:
        """The prompt tokens this step may add so that it ends on a multiple of ``step_multiple``: on CPU every
        linear computes rows in calls of its multiples, and rows past the last one would be padding. What the
        step can add (running prompts' rest, the prompts of waiting requests that fit the free rows, less their
        prefix-cache hits) is counted first; while more requests wait than the step has free rows for, the step
        grows to the largest multiple it can fill, or not at all (its prompts go on a token a step); the last
        prompts are finished at once. Chunking moves no bits (every query is attended on its own, every linear
        at fixed row counts): only the throughput changes. The count is exact where only the budget cuts the
        admissions (not free blocks, a prompt-logprobs cap or a request held back)."""
        table = self.table
        used = int(out.num_tokens[active].sum())
        rest = int((table.total[active] - table.computed[active] - out.num_tokens[active]).clip(min=0).sum())
        free_rows = self.max_num_seqs - len(active)
        owner, coming = min(self.alive, default=0), set()
        for request in self.waiting:
            if free_rows <= 0 or rest >= budget:
                break
            if request.kv is not None:
                cached = request.kv.num_computed
            else:  # a prefix the cache holds, or an earlier admission of this step fills, is not computed again
                cached = self.kv.cached_tokens(owner, request.all_token_ids(),
                                               request.cache_salt(self.kv.prefix_caching), coming)
            rest += request.num_tokens - cached
            free_rows -= 1
        reach = used + min(rest, budget)
        backlog = len(self.waiting) > self.max_num_seqs - len(active)  # then the next step has work anyway
        if reach <= self.step_multiple or (rest <= budget and not backlog):
            return budget  # within one call (padded anyway), or the last prompts: held, they would cost a step
        target = reach // self.step_multiple * self.step_multiple
        return max(0, min(budget, target - used))

    def _take_drafts(self, slots: np.ndarray, counts: np.ndarray, flat: np.ndarray, budget: int,
                     out: StepSchedule) -> int:
        """Schedule the proposed drafts (slots in arrival order) within the budget and the owners'
        blocks; returns the budget used. All at once when everything fits in blank blocks, else
        row by row as budget and blocks allow."""
        table, size = self.table, self.kv.block_size
        fed = table.computed[slots] + out.num_tokens[slots]
        need = np.maximum(-(-(fed + counts) // size) - table.cap[slots] // size, 0)
        has = counts > 0
        if int(counts.sum()) <= budget and self._no_eviction(np.repeat(table.owner[slots], need)):
            self._grow_in_bulk(slots, need, out)
            out.draft_slots, out.draft_counts, out.draft_tokens = slots[has], counts[has], flat
            return int(counts.sum())
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        chosen_slots, chosen_counts, chosen = [], [], []
        used = 0
        for i in np.flatnonzero(has).tolist():
            if budget - used <= 0:
                break
            slot = int(slots[i])
            request = table.requests[slot]
            table.store(slot)
            scheduled = int(out.num_tokens[slot])
            room = self._affordable(request, min(int(counts[i]), budget - used), extra_after=scheduled)
            if room:
                chosen_slots.append(slot)
                chosen_counts.append(room)
                chosen.append(flat[offsets[i] : offsets[i] + room])
                new = self.kv.grow(request.owner, request.kv, request.kv.num_computed + scheduled + room)
                if new:
                    out.new_blocks.setdefault(slot, []).extend(new)
                    table.load(slot)
                used += room
        if chosen_slots:
            out.draft_slots = np.array(chosen_slots, dtype=np.int64)
            out.draft_counts = np.array(chosen_counts, dtype=np.int32)
            out.draft_tokens = np.concatenate(chosen).astype(np.int32)
        return used

    def _no_eviction(self, owners: np.ndarray) -> bool:
        need = np.bincount(owners, minlength=self.num_workers)
        return all(int(k) <= len(pool.blank) for k, pool in zip(need.tolist(), self.kv.pools))

    def _grow_in_bulk(self, slots: np.ndarray, need: np.ndarray, out: StepSchedule) -> None:
        """``need[i]`` new blocks for row ``slots[i]`` (arrival order), when the owners' blank blocks
        suffice (``_no_eviction``): one allocation per owner, handed out in arrival order, which
        gives each row the blocks one-by-one allocation would."""
        grows = need > 0
        slots, need = slots[grows], need[grows]
        if slots.size == 0:
            return
        table = self.table
        owners = table.owner[slots]
        # bincount, not np.unique: owners are small ids, and np.unique's first call imports numpy.ma
        # (~0.2 s, once, in the middle of a run: a stall every worker waits for)
        for owner in np.flatnonzero(np.bincount(owners)).tolist():
            mine = owners == owner
            blocks = self.kv.pools[owner].allocate(int(need[mine].sum()))
            at = 0
            for slot, count in zip(slots[mine].tolist(), need[mine].tolist()):
                new = blocks[at : at + count]
                at += count
                table.requests[slot].kv.block_table.extend(new)
                out.new_blocks.setdefault(slot, []).extend(new)
        table.cap[slots] += need * self.kv.block_size

    def _publish_filled(self, slots: np.ndarray) -> None:
        """Decode rows whose last block fills with this step's token: publish its prefix key
        (arrival order). Registering never allocates, so it is independent of the bulk growth."""
        table, kv, size = self.table, self.kv, self.kv.block_size
        for slot in slots.tolist():
            request = table.requests[slot]
            state = request.kv
            block = state.num_registered
            salt = request.cache_salt(kv.prefix_caching)
            prompt, output = request.prompt_token_ids, request.output_token_ids
            if (len(prompt) + len(output)) // size != block + 1 or salt is None:  # not one new block: the general path
                kv.commit(request.owner, state, TokenView(prompt, output), len(prompt) + len(output), salt)
            else:
                if len(state.keys) <= block:
                    first = block * size - len(prompt)
                    tokens = output[first : first + size] if first >= 0 else TokenView(prompt, output)[
                        block * size : (block + 1) * size]
                    extend_keys(state.keys, tokens, size, salt, block + 1, first_block=block)
                kv.pools[request.owner].register(state.block_table[block], state.keys[block])
                state.num_registered = block + 1
            table.registered[slot] = state.num_registered

    def _one_token_each(self, running: np.ndarray, out: StepSchedule) -> np.ndarray:
        """Step 1 request by request: some owner lacks blocks for every row's next token."""
        table = self.table
        for slot in running.tolist():
            table.store(slot)
        requests = [table.requests[slot] for slot in running.tolist()]
        preempted: set[str] = set()
        active = []
        for request in requests:
            if request.request_id in preempted:
                continue
            while not self._fits(request, request.kv.num_computed + 1):
                victim = next((r for r in reversed(requests)
                               if r.owner == request.owner and r.request_id not in preempted), None)
                self._preempt(victim, out)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if request.request_id in preempted:
                continue
            slot = request.slot
            out.start[slot] = request.kv.num_computed
            out.num_tokens[slot] = 1
            self._extend(request, out)
            active.append(slot)
        return np.array(active, dtype=np.int64)

    def _fits(self, request: Request, total: int) -> bool:
        return self.kv.extra_blocks(request.kv, total) <= self.kv.pools[request.owner].num_free

    def _affordable(self, request: Request, want: int, extra_after: int = 0) -> int:
        """How many of ``want`` more tokens the owner's free blocks can hold."""
        base = request.kv.num_computed + extra_after
        room = (len(request.kv.block_table) + self.kv.pools[request.owner].num_free) * self.kv.block_size - base
        return max(0, min(want, room))

    def _extend(self, request: Request, out: StepSchedule) -> None:
        """Blocks for the tokens scheduled so far, and publish the blocks they fill."""
        slot = request.slot
        table = self.table
        kv = request.kv
        kv.num_computed = int(table.computed[slot])
        computed = kv.num_computed + int(out.num_tokens[slot])
        if computed > len(kv.block_table) * self.kv.block_size:
            new = self.kv.grow(request.owner, kv, computed)
            out.new_blocks.setdefault(slot, []).extend(new)
            table.cap[slot] = len(kv.block_table) * self.kv.block_size
        # Blocks filled by this step are shareable from now on: a later request of this same
        # step reads them after they are written, since every layer writes before it attends.
        if table.salted[slot] and min(computed, len(request.prompt_token_ids) + len(request.output_token_ids)) \
                // self.kv.block_size > kv.num_registered:
            self.kv.commit(request.owner, kv, TokenView(request.prompt_token_ids, request.output_token_ids),
                           computed, request.cache_salt(self.kv.prefix_caching))
            table.registered[slot] = kv.num_registered

    def _preempt(self, request: Request, out: StepSchedule) -> None:
        if request.slot is not None and out.num_tokens[request.slot]:
            raise RuntimeError(f"preempting {request.request_id} after scheduling it")  # victims are unscheduled
        self.release(request)
        request.preempt()
        out.preempted.append(request)
        self.num_preemptions += 1

    def requeue_front(self, requests: list[Request]) -> None:
        """Put requests back at the head of the queue, oldest first."""
        for request in sorted(requests, key=lambda r: r.arrival_seq, reverse=True):
            self.waiting.appendleft(request)

    def _pinned_owner(self, request: Request) -> int | None:
        """The pinned owner of n > 1 siblings (they share child 0's blocks), if it is alive with a free
        row; the others get theirs from ``OwnerPicker``."""
        owner = request.pinned_owner
        return owner if owner in self.alive and self.load[owner] < self.rows_per_worker else None

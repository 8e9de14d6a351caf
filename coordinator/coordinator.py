"""The coordinator: requests, the persistent batch and the plan of every step.

It never touches logits. A step, read in order:

- ``next_plan``: retire finished rows, let the scheduler pick each row's tokens and
  blocks (token budget, chunked prefill, prefix-cache hits, preemption), build the
  BatchUpdate (with swaps that keep each worker's shard contiguous), emit a ``StepPlan``;
- the executor runs it on the workers (``cluster.engine.engine_step``);
- ``accept_step``: the sampled tokens are accepted and checked against the finish rule
  (``coordinator.output.acceptance``, ``coordinator.output.finish_rule``);
- ``take_outputs``: outputs are built (``coordinator.output.outputs``), off the critical path.

Around it: admission (``coordinator.intake.admission``) and failures (the methods under
"failures", with ``coordinator.intake.quarantine``). A request with ``n > 1`` is ``n``
sibling rows whose outputs come back together as one ``RequestOutput``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from contextlib import contextmanager
from typing import Any

import numpy as np

from coordinator.coordinator_config import CoordinatorConfig, KVSettings, ModelInfo
from coordinator.intake.admission import Admission
from coordinator.intake.prefix_order import requests_by_prefix
from coordinator.intake.quarantine import EngineFault, Quarantine
from coordinator.kv_blocks import KVCacheManager
from coordinator.metrics import EngineMetrics
from coordinator.output.acceptance import Acceptance
from coordinator.output.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from coordinator.output.outputs import OutputBuilder
from coordinator.output.stop_bytes import StopScanner
from coordinator.request import FinishReason, Request, RequestGroup, RequestOutput, RequestStatus
from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch, group_by_owner
from coordinator.schedule.plan_arrays import drafts_by_row, runs_by_row
from coordinator.schedule.scheduler import Scheduler, StepSchedule
from coordinator.spec.draft_policy import DraftPolicy
from coordinator.spec.ngram_batch import BatchNgramDrafter
from coordinator.spec.ngram_drafter import NgramDrafter
from coordinator.spec.proposals import propose_drafts
from processors import SamplingParams
from workers.wire import EMPTY, AddedRow, PlanUpdate, StepPlan, StepResult

__all__ = ["Coordinator", "CoordinatorConfig", "KVSettings", "ModelInfo", "EngineMetrics"]

# A request that asks for prompt logprobs has a row of float32 logits for each prompt token a step computes:
# its chunks are cut so that a step holds at most this many bytes of them (vLLM had to bound the same, #44886).
PROMPT_LOGITS_BYTES = 64 << 20


class Coordinator:
    def __init__(self, tokenizer: Any, model: ModelInfo, config: CoordinatorConfig,
                 drafter: NgramDrafter | None = None, draft_policy: DraftPolicy | None = None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.metrics = EngineMetrics()
        self.drafter = drafter
        self.draft_policy = draft_policy if drafter is not None else None
        kv = config.kv
        self.kv = KVCacheManager(config.num_workers, kv.num_blocks, kv.block_size, kv.prefix_caching)
        self._drafts = BatchNgramDrafter(drafter, config.max_num_seqs) if drafter is not None else None
        self.quarantine = quarantine = Quarantine()
        self.scheduler = Scheduler(config.max_num_seqs, config.num_workers, config.rows_per_worker,
                                   kv.max_num_batched_tokens, self.kv, model.max_model_len,
                                   admits=lambda request: quarantine.admits(request.group.request_id),
                                   on_release=self._drafts.release if self._drafts is not None else None,
                                   step_multiple=config.step_multiple, max_loras=config.max_loras,
                                   prompt_logprob_chunk=max(16, PROMPT_LOGITS_BYTES // (4 * model.vocab_size)))
        self.batch = PersistentBatch(config.max_num_seqs)
        self.kv_note: str | None = None  # where the workers' KV budget came from (cluster.memory)
        self.requests: dict[str, RequestGroup] = {}  # by the caller's request id
        self.rows: dict[str, Request] = {}  # by row id (a child of an n > 1 request has its own)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.admission = Admission(tokenizer, model, config)
        self.outputs = OutputBuilder(tokenizer, self.detokenizers)
        self.acceptance = Acceptance(tokenizer, self.scheduler, self.metrics, self.outputs, self.detokenizers,
                                     self._finished_row, self._drafts, self.draft_policy)
        # Rows to drop from the batch at the next plan: the requests themselves, not their ids, as an
        # id may be given to a new request before that plan (the old one's slot must still be released).
        self._to_remove: list[Request] = []
        self._plan_slots: np.ndarray = EMPTY  # each row's slot in the last plan
        self._plan_started = 0.0
        self._last_schedule: StepSchedule | None = None
        self._step = 0
        self._next_id = 0

    # ----- requests -----

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's own copy of its params; the engine's defaults where it gave none."""
        if params is None or params._engine_defaults:
            lora = None if params is None else params._lora
            params = self.config.default_params.clone()
            params._lora = lora
            return params
        return params.clone()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    rejected: str | None = None, final_only: bool = False) -> str:
        """Queue a request; one that fails validation finishes at once with an error.

        ``prompt_token_ids``: a text prompt already tokenized (outside any lock, by ``tokenize``);
        ``rejected``: the caller already found the request invalid (it finishes with that error);
        ``final_only``: ``take_outputs`` returns only its final output.
        """
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        existing = self.requests.get(request_id)
        if existing is not None and not existing.finished:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.outputs.reused(request_id)  # a finished request's id: its undelivered output is not the new one's
        params = self._params(params)
        text = prompt if isinstance(prompt, str) else None
        try:
            if rejected is not None:
                raise ValueError(rejected)
            prompt_ids = list(prompt_token_ids) if prompt_token_ids is not None else self.admission.prompt_ids(prompt)
        except ValueError as exc:
            prompt_ids = []
            error = str(exc)
        else:
            error = self.admission.error(prompt_ids, params, request_id)
        group = RequestGroup(request_id, final_only=final_only)
        if error is None and params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_ids)
        n = params.n if error is None else 1
        for index in range(n):
            child_params = params if n == 1 else params.child(index)
            row_id = request_id if n == 1 else f"{request_id}#{index}"
            if row_id in self.rows and not self.rows[row_id].finished:
                raise ValueError(f"request id {row_id!r} is already in use")
            request = Request(row_id, text, prompt_ids, child_params, group=group, child_index=index)
            if child_params.logprobs is not None:
                request.logprobs = []
            group.children.append(request)
        self.requests[request_id] = group
        for request in group.children:
            self.rows[request.request_id] = request
            self.outputs.register(request.request_id)
            if error is not None:
                request.refused = True
                request.finish(FinishReason.ERROR, error=error)
                continue
            self.admission.compile_later(request)
            self.detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
            )
            self.scheduler.add(request)
        if error is not None:
            self.outputs.due(group)
        else:
            self.metrics.prompt_tokens += len(prompt_ids) * n  # each sequence's prompt (n > 1 shares blocks)
        return request_id

    @contextmanager
    def submitting_together(self) -> Iterator[None]:
        """The requests added inside (one ``submit_many``) enter the queue with those sharing a prompt prefix
        side by side (``group_by_prefix``; ``coordinator.intake.prefix_order``), so a shared prefix is computed
        once while its group runs. Their ids are given in the caller's order all the same."""
        self.scheduler.hold()
        try:
            yield
        finally:
            self.scheduler.release_held(requests_by_prefix if self.config.group_by_prefix else None)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text prompt; ValueError, before any work, for one that cannot fit."""
        return self.admission.tokenize(text)

    def _fail_bad_constraints(self) -> None:
        for request, error in self.admission.failed_constraints():
            self.scheduler.waiting.remove(request)
            request.finish(FinishReason.ERROR, error=error)
            self.outputs.due(request.group)

    def abort(self, request_id: str) -> bool:
        """Stop a request (every completion of it) now; False if it is unknown or already finished."""
        group = self.requests.get(request_id)
        if group is None or group.finished:
            return False
        for request in group.children:
            if request.finished:
                continue
            if request.status == RequestStatus.WAITING:
                self.scheduler.remove_waiting(request.request_id)
            else:
                self._to_remove.append(request)
                self._mark_done(request)
            request.finish(FinishReason.ABORT)
            self.acceptance.finalize_text(request)
        self.outputs.due(group)
        self.quarantine.finished(request_id)
        return True

    def kv_summary(self) -> str:
        return self.kv.summary(self.model.max_model_len, self.batch.max_num_reqs, self.kv_note)

    def kv_stats(self) -> dict[str, Any]:
        return {
            "kv_usage": self.kv.usage(),
            "prefix_hit_tokens": self.kv.hit_tokens,
            "prompt_tokens": self.metrics.prompt_tokens,
            "prefill_tokens": self.metrics.prefill_tokens,
            "preemptions": self.scheduler.num_preemptions,
        }

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting) or self.batch.num_reqs > 0 or bool(self._to_remove)

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a compiling constraint when nothing else can run."""
        pending = [r.grammar for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.done()]
        if pending and self.batch.num_reqs == 0:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def num_running(self) -> int:
        return self.batch.num_reqs

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ----- failures -----

    def requeue_running(self, alive_workers: Sequence[int]) -> int:
        """After a worker failure: put every running request back in the queue, in arrival order.

        The failed step's results are discarded; each request keeps the tokens it
        had accepted before it, and the next plan re-adds it (prompt + those tokens
        are prefilled again) on a live worker. Returns how many were requeued.
        """
        running = self._batch_requests()
        self.batch = PersistentBatch(self.batch.max_num_reqs)
        self._to_remove = []
        self.acceptance.take_last()
        self._plan_slots = EMPTY
        self._last_schedule = None
        for request in running:
            self.scheduler.release(request)
        for request in self.scheduler.waiting:
            request.kv, request.kv_owner = None, None
        requeue = [r for r in running if not r.finished]
        for request in requeue:
            request.status = RequestStatus.WAITING
        self.scheduler.requeue_front(requeue)
        self.scheduler.set_workers(alive_workers)
        for group in self.requests.values():
            group.owner, group.prompt_ready = None, False
        return len(requeue)

    def _batch_requests(self) -> list[Request]:
        """The batch's requests, in its order. A row that finished (or was aborted) and leaves at the
        next plan is itself even where a new request has taken its id since: ``self.rows`` names the
        new one, which is waiting, not in the batch."""
        leaving = {r.request_id: r for r in self._to_remove}
        return [leaving[e.request_id] if e.request_id in leaving else self.rows[e.request_id]
                for e in self.batch.entries()]

    def fail_requests(self, request_ids: Sequence[str], message: str, retryable: bool = False) -> None:
        """Fail rows (by row id); their requests report the error."""
        self._fail([self.rows[row_id] for row_id in request_ids], message, retryable)

    def _fail(self, requests: Sequence[Request], message: str, retryable: bool = False) -> None:
        for request in requests:
            if not request.finished:
                request.finish(FinishReason.ERROR, error=message, retryable=retryable)
                self._mark_done(request)
                self.acceptance.finalize_text(request)
                self.outputs.due(request.group)
                self._left(request)

    def fail_step(self, rows: Sequence[int] | None, message: str, alive_workers: Sequence[int]) -> list[str]:
        """A step raised: fail the requests of ``rows`` when the error names them; otherwise every
        request of the step is a suspect (``Quarantine``). Everyone else is re-admitted with the
        tokens they have, exactly as after a worker failure. Workers must be reset. Returns the
        failed row ids."""
        batch = self._batch_requests()
        if rows:
            convicted = [batch[r] for r in rows if 0 <= r < len(batch)]
            self._fail(convicted, message)
            failed = [r.request_id for r in convicted]
        else:
            failed = self._suspected(batch, message)
        self.requeue_running(alive_workers)
        return failed

    def worker_failed(self, workers: Sequence[int], cause: str, alive_workers: Sequence[int]) -> bool:
        """Workers died or hung: the requests they held are suspects (``Quarantine``), every running
        request is re-admitted on the live workers. Returns whether suspects were running apart
        when it happened (finding a poison request: not the workers' own fault)."""
        probing = self.quarantine.active is not None
        table = self.scheduler.table
        lost = set(workers)
        held = [r for r in self._batch_requests() if int(table.owner[r.slot]) in lost]
        self._suspected(held, f"a worker {cause}")
        self.requeue_running(alive_workers)
        return probing

    def _suspected(self, rows: Sequence[Request], cause: str) -> list[str]:
        """These rows were present at a failure no request explains. The requests the quarantine
        convicts are held, not failed: the engine first checks that it still computes correctly
        (``settle_convictions``), since a fault of the engine's own also fails every request alone.
        Returns the failed row ids (none: they fail when settled)."""
        groups = {r.group.request_id: r.group for r in rows}
        for group_id in self.quarantine.failed(list(groups)):
            self.quarantine.held[group_id] = cause
        return []

    def convictions_pending(self) -> bool:
        """Whether convicted requests wait for ``settle_convictions``."""
        return bool(self.quarantine.held)

    def settle_convictions(self, engine_problem: str | None) -> None:
        """The engine checked itself after convicting requests. Healthy (``engine_problem`` None): the
        convicted fail, not retryable. Not healthy: the fault is the engine's; ``EngineFault`` is raised
        and the convicted stay unfinished, for the host to fail as retryable with everyone else."""
        if engine_problem is not None:
            raise EngineFault(f"the engine is broken, not the requests it ran: {engine_problem}")
        for group_id, cause in list(self.quarantine.held.items()):
            group = self.requests.get(group_id)
            self.quarantine.held.pop(group_id, None)
            if group is None:
                continue
            children = [c for c in group.children if not c.finished]
            for child in children:
                if child.status == RequestStatus.WAITING:
                    self.scheduler.remove_waiting(child.request_id)
            self._fail(children, self.quarantine.message(cause))

    def _left(self, request: Request) -> None:
        """A request's group has no unfinished row left: it is nobody's suspect any more."""
        if request.group is not None and request.group.finished:
            self.quarantine.finished(request.group.request_id)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every unfinished request with an error (no worker left, replicas diverged)."""
        for request in self.rows.values():
            if not request.finished:
                request.finish(FinishReason.ERROR, error=message, retryable=True)
                self.outputs.due(request.group)
        self.scheduler.waiting.clear()
        for request in self._batch_requests():
            self.scheduler.release(request)
        self.batch = PersistentBatch(self.batch.max_num_reqs)
        self._to_remove, self._plan_slots = [], EMPTY
        self.acceptance.take_last()
        self.quarantine = Quarantine()
        return self.take_outputs()

    # ----- one step -----

    def next_plan(self) -> StepPlan | None:
        """Retire finished rows, schedule tokens and blocks, and describe the step; None when idle."""
        self._plan_started = time.perf_counter()
        self._forget_delivered()
        self._fail_bad_constraints()
        leaving = list({id(r): r for r in self._to_remove}.values())
        self._to_remove = []
        finished = [r.request_id for r in leaving]
        table = self.scheduler.table
        keep = np.ones(self.batch.num_reqs, dtype=bool)
        for request in leaving:
            keep[self.batch.row_of(request.request_id)] = False
            self.scheduler.release(request)
            if self.draft_policy is not None and request.finished:
                self.draft_policy.forget(request.request_id)
        running = self.batch.row_slots()[keep]
        decision = self.scheduler.schedule(running, self._propose if self._drafts is not None else None)
        for request in decision.preempted:
            finished.append(request.request_id)
        self.scheduler.requeue_front(decision.preempted)
        for request in decision.admitted:
            request.status = RequestStatus.RUNNING
            group = request.group
            if request.child_index == 0 and group.owner is None:
                group.owner = request.owner
        self._mark_prompts_ready(decision)
        admitted = decision.admitted
        for request in admitted:
            detok = self.detokenizers.get(request.request_id)
            if self._drafts is not None:
                self._drafts.admit(request.slot, request.prompt_token_ids + request.output_token_ids)
            if detok is not None and detok.stop:
                table.detokenizers[request.slot] = detok
                if self.acceptance.token_bytes is not None and detok._stream is not None and not any(
                        REPLACEMENT_CHAR in stop for stop in detok.stop):  # U+FFFD also stands for invalid bytes
                    table.stop_scanners[request.slot] = StopScanner(detok.stop, detok.max_stop_len)
        entries = [BatchEntry(r.request_id, r.params, r.prompt_token_ids, r.output_token_ids, r.slot) for r in admitted]
        if not finished and not entries and self.batch.num_reqs == 0:
            return None
        rows = self.batch.update(finished, entries)
        shards = group_by_owner(self.batch, table.owner[self.batch.row_slots()], self.scheduler.num_workers)
        update = self.batch.take_update()
        plan_update = None
        if update is not None:
            added = [
                AddedRow(row, r.request_id, r.params, list(r.prompt_token_ids), list(r.output_token_ids), r.owner)
                for row, r in zip(rows, admitted)
            ]
            plan_update = PlanUpdate(update.batch_size, list(update.removed), added, list(update.moved))
        slots = self.batch.row_slots().copy()
        row_of_slot = np.empty(table.capacity, dtype=np.int64)
        row_of_slot[slots] = np.arange(len(slots))
        block_rows, block_counts, block_ids = runs_by_row(decision.new_blocks, row_of_slot)
        draft_tokens = draft_counts = None
        if decision.draft_slots.size:  # None: plain sampling
            draft_counts, draft_tokens = drafts_by_row(decision, row_of_slot, len(slots))
        self._step += 1
        every = self.config.consistency_check_every
        last_tokens, last_counts = self.acceptance.take_last()
        plan = StepPlan(
            step=self._step,
            last_tokens=last_tokens,
            last_counts=last_counts,
            update=plan_update,
            shards=shards,
            start=decision.start[slots],
            num_tokens=decision.num_tokens[slots].astype(np.int32),
            block_rows=block_rows,
            block_counts=block_counts,
            block_ids=block_ids,
            draft_tokens=draft_tokens,
            draft_counts=draft_counts,
            audit=bool(every) and self._step % every == 0,
        )
        self._plan_slots = slots
        self._last_schedule = decision
        return plan

    def _mark_prompts_ready(self, decision: StepSchedule) -> None:
        """Prefill metrics and prompt readiness (a group's owner is its first row's worker)."""
        slots = decision.scheduled
        prefill, ready = self.scheduler.table.prompt_progress(slots, decision.start[slots], decision.num_tokens[slots])
        self.metrics.prefill_tokens += prefill
        for request in ready:
            request.group.prompt_ready = True
            if request.group.owner is None:
                request.group.owner = request.owner

    def _propose(self, slots: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
        table = self.scheduler.table
        return propose_drafts(self._drafts, self.draft_policy, slots, table.limit[slots] - table.total[slots], budget,
                              bool(self.scheduler.waiting),
                              lambda: [table.requests[slot].request_id for slot in slots.tolist()])

    def accept_step(self, plan: StepPlan, results: Sequence[StepResult]) -> None:
        """Take the sampled tokens of ``plan``'s step and apply the finish rule: all the next plan
        needs. Building outputs (``take_outputs``) can wait until the next step is sent."""
        self.acceptance.accept(plan, results, self._plan_slots, self._plan_started)

    def _finished_row(self, request: Request) -> None:
        """A row finished this step: it leaves the batch at the next plan; its output is due."""
        self._mark_done(request)
        self._left(request)
        self._to_remove.append(request)
        if request.group.finished or not request.group.final_only:
            self.outputs.due(request.group)

    def _mark_done(self, request: Request) -> None:
        if request.slot is not None:
            self.scheduler.table.done[request.slot] = True

    def decode_ahead(self) -> None:
        """Bring running requests' text up to their tokens, while the workers compute. Without stop
        strings, text is decoded only when an output is built: for final-only requests that finish
        together that is one burst in one step (1,024 requests of 64 tokens: ~0.16 s); called each
        step, the same decoding is spread over the steps and off their critical path."""
        for row_id, detok in self.detokenizers.items():
            request = self.rows.get(row_id)
            if request is not None and not request.finished:
                detok.catch_up(request.output_token_ids)

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs since the last call; a finished request's final output is delivered once, then forgotten."""
        return self.outputs.take()

    def _forget_delivered(self) -> None:
        """Drop finished, delivered requests whose rows have left the batch: a long-lived engine stays flat."""
        if not self.outputs.delivered:
            return
        keep = []
        for request_id in self.outputs.delivered:
            group = self.requests.get(request_id)
            if group is None or not group.finished:
                continue  # re-used id, running again
            if any(c.slot is not None for c in group.children):  # still holds a row until the next plan
                keep.append(request_id)
                continue
            del self.requests[request_id]
            for child in group.children:
                self.rows.pop(child.request_id, None)
                self.outputs.forget(child.request_id)
        self.outputs.delivered = keep

"""The coordinator: requests, admission, the persistent batch and the plan of every step.

It never touches logits. Each step it takes the workers' sampled tokens,
applies stop conditions and detokenization, then lets the scheduler pick each
row's tokens and blocks (token budget, chunked prefill, prefix-cache hits,
preemption), builds the BatchUpdate (with swaps that keep each worker's shard
contiguous) and emits the next ``StepPlan``. A request with ``n > 1`` is ``n``
sibling rows whose outputs come back together as one ``RequestOutput``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from coordinator.draft_policy import CRITICAL_SHARE, DraftPolicy
from coordinator.kv_blocks import KVCacheManager
from coordinator.ngram_batch import BatchNgramDrafter
from coordinator.ngram_drafter import NgramDrafter
from coordinator.persistent_batch import BatchEntry, PersistentBatch
from coordinator.prompt_limits import check_prompt_chars, max_prompt_chars
from coordinator.quarantine import Quarantine
from workers.wire import EMPTY, AddedRow, PlanUpdate, StepPlan, StepResult, offsets_of
from coordinator.request import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PositionLogprobs,
    Request,
    RequestGroup,
    RequestOutput,
    RequestStatus,
)
from coordinator.rates import WindowedRate
from coordinator.stop_bytes import StopScanner, complete_utf8, token_bytes
from coordinator.scheduler import Scheduler, StepSchedule, group_by_owner
from processors import SamplingParams, validate_logits_processors_parameters
from processors.sampling_params import SAMPLING_EPS
from processors.request_level import RequestLevelAdapter, check_request_setting
from processors.structured_output import GrammarCache
from workers.sampler import Sampler, TokenLogprobs


@dataclass
class EngineMetrics:
    steps: int = 0
    generated_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    prefill_tokens: int = 0  # tokens computed for prompts (and recomputed outputs), not decode tokens
    started: float = field(default_factory=time.monotonic)
    generation_rate: WindowedRate = field(default_factory=WindowedRate)  # output tokens/s, last 10 s

    @property
    def spec_acceptance(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None


@dataclass(frozen=True)
class ModelInfo:
    """What the coordinator needs to know about the model (no weights)."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    generation_config: dict[str, Any]

    @classmethod
    def load(cls, model_path: str, max_model_len: int | None, tokenizer: Any, trust_remote_code: bool = False) -> ModelInfo:
        from transformers import AutoConfig, GenerationConfig

        from workers.model_support import resolved_max_model_len

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        try:
            generation = GenerationConfig.from_pretrained(model_path).to_dict()
        except OSError:
            generation = {}
        eos = tokenizer.eos_token_id
        if eos is None:
            gen_eos = generation.get("eos_token_id")
            eos = gen_eos[0] if isinstance(gen_eos, list) and gen_eos else gen_eos
        return cls(
            vocab_size=config.vocab_size,
            max_model_len=resolved_max_model_len(config, max_model_len),
            eos_token_id=eos,
            generation_config={"eos_token_id": generation.get("eos_token_id")},
        )


@dataclass(frozen=True)
class KVSettings:
    """Block geometry the workers reported, and the scheduling knobs that depend on it."""

    num_blocks: int  # per worker
    block_size: int = 16
    prefix_caching: bool = True
    max_num_batched_tokens: int = 2048


class Coordinator:
    def __init__(self, tokenizer: Any, model: ModelInfo, max_num_seqs: int, num_workers: int, rows_per_worker: int,
                 kv: KVSettings, seed: int = 0, custom_processors: Sequence[Any] = (),
                 consistency_check_every: int = 0, default_params: SamplingParams | None = None,
                 drafter: NgramDrafter | None = None, reasoning_enabled: bool = False,
                 processors_from_entry_points: bool = True, grammar_cache_size: int = 256,
                 max_logprobs: int = 20, draft_policy: DraftPolicy | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self._token_texts: dict[int, str] = {}
        self.drafter = drafter
        self.draft_policy = draft_policy if drafter is not None else None
        self._plan_started = 0.0
        self.reasoning_enabled = reasoning_enabled
        self.metrics = EngineMetrics()
        self.model = model
        self.seed = seed
        self.custom_processors = tuple(custom_processors)
        self.processors_from_entry_points = processors_from_entry_points
        self.consistency_check_every = consistency_check_every
        self.default_params = default_params or SamplingParams()
        self.kv = KVCacheManager(num_workers, kv.num_blocks, kv.block_size, kv.prefix_caching)
        self.scheduler = Scheduler(max_num_seqs, num_workers, rows_per_worker, kv.max_num_batched_tokens, self.kv,
                                   model.max_model_len)
        self._drafts = BatchNgramDrafter(drafter, max_num_seqs) if drafter is not None else None
        if self._drafts is not None:
            self.scheduler.table.on_release = self._drafts.release
        self.batch = PersistentBatch(max_num_seqs)
        self.kv_note: str | None = None  # where the workers' KV budget came from (cluster.memory)
        self.quarantine = Quarantine()
        self.scheduler.admits = lambda request: self.quarantine.admits(request.group.request_id)
        self.requests: dict[str, RequestGroup] = {}  # by the caller's request id
        self.rows: dict[str, Request] = {}  # by row id (a child of an n > 1 request has its own)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, tuple[int, int]] = {}  # row id -> (text chars, tokens) already reported
        self._to_remove: list[str] = []  # rows to drop from the batch at the next plan
        self._delivered: list[str] = []  # finished requests whose final output was taken
        self._last_tokens: np.ndarray = EMPTY  # accepted last step, flat, rows of the plan's layout
        self._last_counts: np.ndarray | None = None  # per row; None: one each
        self._plan_slots: np.ndarray = EMPTY  # each row's slot in the last plan
        self._streamed: list[Request] = []  # streaming rows that gained tokens; their outputs are built later
        self._compiling: list[Request] = []  # waiting requests whose constraint is compiling
        self._last_schedule: StepSchedule | None = None
        self._step = 0
        self._next_id = 0
        self._pending_outputs: dict[str, RequestGroup] = {}
        self._grammar_cache: GrammarCache | None = None
        self._compile_pool: ThreadPoolExecutor | None = None
        self.grammar_cache_size = grammar_cache_size
        # Token id -> bytes, when the tokenizer decodes by concatenating them (coordinator.stop_bytes).
        self._token_bytes = token_bytes(tokenizer)
        self._max_prompt_chars: int | None = None  # coordinator.prompt_limits, on the first text prompt
        self._complete_utf8 = complete_utf8(self._token_bytes) if self._token_bytes is not None else None
        # Accept every row with per-request code, as before the array path existed: the
        # reference the array path must equal (tests compare the two).
        self.per_row_reference = False

    # ----- requests -----

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
        params = (params or self.default_params).clone()
        text = prompt if isinstance(prompt, str) else None
        try:
            if rejected is not None:
                raise ValueError(rejected)
            prompt_ids = list(prompt_token_ids) if prompt_token_ids is not None else self._prompt_ids(prompt)
        except ValueError as exc:
            prompt_ids = []
            error = str(exc)
        else:
            error = self._admission_error(prompt_ids, params, request_id)
        group = RequestGroup(request_id, final_only=final_only)
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
            self._emitted[request.request_id] = (0, 0)
            if error is not None:
                request.finish(FinishReason.ERROR, error=error)
                continue
            request.grammar = self._compile_later(params)
            if request.grammar is not None:
                self._compiling.append(request)
            self.detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
            )
            self.scheduler.add(request)
        if error is not None:
            self._pending_outputs[request_id] = group
        return request_id

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text prompt; ValueError, before any work, for one that cannot fit."""
        if self._max_prompt_chars is None:
            self._max_prompt_chars = max_prompt_chars(self.tokenizer, self.model.max_model_len)
        check_prompt_chars(text, self._max_prompt_chars, self.model.max_model_len)
        return list(self.tokenizer(text)["input_ids"])

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of integer token ids")
        return list(prompt)

    def _admission_error(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str | None:
        """Complete the params for this model and check everything; return the problem, if any."""
        vocab, limit = self.model.vocab_size, self.model.max_model_len
        if not prompt_ids:
            return "prompt is empty"
        bad = sorted({t for t in prompt_ids if not 0 <= t < vocab})
        if bad:
            return f"prompt has token id(s) {bad[:8]} outside the vocabulary [0, {vocab})"
        if len(prompt_ids) >= limit:
            return (f"prompt has {len(prompt_ids)} tokens; max_model_len is {limit}, "
                    "which leaves no room to generate")
        cap = vocab if self.max_logprobs == -1 else min(self.max_logprobs, vocab)
        if params.logprobs == -1:  # vLLM: the whole vocabulary
            params.logprobs = vocab
        if params.logprobs is not None and params.logprobs > cap:
            return (f"Requested sample logprobs of {params.logprobs}, which is greater than max allowed: {cap} "
                    "(model.max_logprobs, at most the vocabulary; logprobs=-1 asks for all of it)")
        if params.thinking_token_budget is not None and not self.reasoning_enabled:
            return "thinking_token_budget needs a reasoning section (start/end) in the engine config"
        if params.n > self.scheduler.rows_per_worker:
            return (f"n={params.n} siblings share one worker's blocks, which holds at most "
                    f"{self.scheduler.rows_per_worker} rows (scheduler.max_num_seqs_per_worker)")
        try:
            params.update_from_generation_config(self.model.generation_config, self.model.eos_token_id)
            params.update_from_tokenizer(self.tokenizer)
            Sampler.validate(params, vocab)
            validate_logits_processors_parameters(self.custom_processors, params, self.processors_from_entry_points)
            for spec in self.custom_processors:
                if _is_request_level(spec):
                    check_request_setting(spec.kwargs, params)
        except ValueError as exc:
            return str(exc)
        except Exception as exc:  # a custom validate_params that is not a ValueError
            return f"{type(exc).__name__}: {exc}"
        params.assign_request_key(request_id, self.seed)
        return None

    def _grammars(self) -> GrammarCache:
        if self._grammar_cache is None:
            self._grammar_cache = GrammarCache(self.tokenizer, self.model.vocab_size, self.grammar_cache_size)
        return self._grammar_cache

    def _compile_later(self, params: SamplingParams) -> Future | None:
        """Compile a new constraint off the step loop; the request is admitted once it is ready.

        Compiling also validates: a bad schema, regex or grammar fails only its request."""
        constraint = params.structured_outputs
        if constraint is None or self._grammars().cached(constraint):
            return None
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raysample-grammar")
        return self._compile_pool.submit(self._grammars().get, constraint)

    def _fail_bad_constraints(self) -> None:
        """Waiting requests whose constraint failed to compile finish with the error (only those
        still compiling are looked at, not the whole queue)."""
        if not self._compiling:
            return
        still = []
        for request in self._compiling:
            if request.grammar is None or request.status != RequestStatus.WAITING:
                continue
            if not request.grammar.done():
                still.append(request)
                continue
            error = request.grammar.exception()
            request.grammar = None
            if error is not None:
                self.scheduler.waiting.remove(request)
                request.finish(FinishReason.ERROR, error=str(error))
                self._pending_outputs[request.group.request_id] = request.group
        self._compiling = still

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
                self._to_remove.append(request.request_id)
                self._mark_done(request)
            request.finish(FinishReason.ABORT)
            self._finalize_text(request)
        self._pending_outputs[request_id] = group
        self.quarantine.finished(request_id)
        return True

    def kv_summary(self) -> str:
        """One line on the KV cache and the concurrency it allows (logged at start-up)."""
        blocks, size = self.kv.pools[0].num_blocks, self.kv.block_size
        per_seq = self.kv.blocks_for(self.model.max_model_len)
        workers = len(self.kv.pools)
        budget = f"; budget {self.kv_note}" if self.kv_note else ""
        return (f"KV cache: {blocks} blocks of {size} tokens on each of {workers} worker(s) = "
                f"{blocks * size * workers} tokens; {blocks // per_seq * workers} sequences of "
                f"max_model_len={self.model.max_model_len} at once, more when shorter "
                f"(max_num_seqs={self.batch.max_num_reqs}); prefix caching "
                f"{'on' if self.kv.prefix_caching else 'off'}{budget}")

    def kv_stats(self) -> dict[str, Any]:
        return {
            "kv_usage": self.kv.usage(),
            "prefix_hit_tokens": self.kv.hit_tokens,
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

    def requeue_running(self, alive_workers: Sequence[int]) -> int:
        """After a worker failure: put every running request back in the queue, in arrival order.

        The failed step's results are discarded; each request keeps the tokens it
        had accepted before it, and the next plan re-adds it (prompt + those tokens
        are prefilled again) on a live worker. Returns how many were requeued.
        """
        running = [self.rows[e.request_id] for e in self.batch.entries()]
        self.batch = PersistentBatch(self.batch.max_num_reqs)
        self._to_remove = []
        self._last_tokens, self._last_counts, self._plan_slots = EMPTY, None, EMPTY
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

    def fail_requests(self, request_ids: Sequence[str], message: str, retryable: bool = False) -> None:
        """Fail rows (by row id); their requests report the error."""
        for row_id in request_ids:
            request = self.rows[row_id]
            if not request.finished:
                request.finish(FinishReason.ERROR, error=message, retryable=retryable)
                self._mark_done(request)
                self._finalize_text(request)
                self._pending_outputs[request.group.request_id] = request.group
                self._left(request)

    def fail_step(self, rows: Sequence[int] | None, message: str, alive_workers: Sequence[int]) -> list[str]:
        """A step raised: fail the requests of ``rows`` when the error names them; otherwise every
        request of the step is a suspect (``Quarantine``). Everyone else is re-admitted with the
        tokens they have, exactly as after a worker failure. Workers must be reset. Returns the
        failed row ids."""
        ids = self.batch.request_ids()
        if rows:
            failed = [ids[r] for r in rows if 0 <= r < len(ids)]
            self.fail_requests(failed, message)
        else:
            failed = self._suspected(ids, message)
        self.requeue_running(alive_workers)
        return failed

    def worker_failed(self, workers: Sequence[int], cause: str, alive_workers: Sequence[int]) -> bool:
        """Workers died or hung: the requests they held are suspects (``Quarantine``), every running
        request is re-admitted on the live workers. Returns whether suspects were running apart
        when it happened (finding a poison request: not the workers' own fault)."""
        probing = self.quarantine.active is not None
        table = self.scheduler.table
        held = [e.request_id for e in self.batch.entries()
                if int(table.owner[self.rows[e.request_id].slot]) in set(workers)]
        self._suspected(held, f"a worker {cause}")
        self.requeue_running(alive_workers)
        return probing

    def _suspected(self, row_ids: Sequence[str], cause: str) -> list[str]:
        """These rows were present at a failure no request explains; fail the requests the
        quarantine convicts. Returns the failed row ids."""
        groups = list(dict.fromkeys(self.rows[r].group.request_id for r in row_ids))
        failed = []
        for group_id in self.quarantine.failed(groups):
            rows = [c.request_id for c in self.requests[group_id].children if not c.finished]
            self.fail_requests(rows, self.quarantine.message(cause))
            failed += rows
        return failed

    def _left(self, request: Request) -> None:
        """A request's group has no unfinished row left: it is nobody's suspect any more."""
        if request.group is not None and request.group.finished:
            self.quarantine.finished(request.group.request_id)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every unfinished request with an error (no worker left, replicas diverged)."""
        for request in self.rows.values():
            if not request.finished:
                request.finish(FinishReason.ERROR, error=message, retryable=True)
                self._pending_outputs[request.group.request_id] = request.group
        self.scheduler.waiting.clear()
        for entry in self.batch.entries():
            self.scheduler.release(self.rows[entry.request_id])
        self.batch = PersistentBatch(self.batch.max_num_reqs)
        self._to_remove, self._last_tokens, self._last_counts, self._plan_slots = [], EMPTY, None, EMPTY
        self.quarantine = Quarantine()
        return self.take_outputs()

    # ----- one step -----

    def next_plan(self) -> StepPlan | None:
        """Retire finished rows, schedule tokens and blocks, and describe the step; None when idle."""
        self._plan_started = time.perf_counter()
        self._forget_delivered()
        self._fail_bad_constraints()
        finished = list(dict.fromkeys(self._to_remove))
        self._to_remove = []
        table = self.scheduler.table
        keep = np.ones(self.batch.num_reqs, dtype=bool)
        for rid in finished:
            keep[self.batch.row_of(rid)] = False
            self.scheduler.release(self.rows[rid])
            if self.draft_policy is not None and self.rows[rid].finished:
                self.draft_policy.forget(rid)
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
                if self._token_bytes is not None and detok._stream is not None and not any(
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
        block_rows, block_counts, block_ids = _runs_by_row(decision.new_blocks, row_of_slot)
        draft_tokens = draft_counts = None
        if decision.draft_slots.size:  # None: plain sampling
            draft_counts, draft_tokens = _drafts_by_row(decision, row_of_slot, len(slots))
        self._step += 1
        every = self.consistency_check_every
        plan = StepPlan(
            step=self._step,
            last_tokens=self._last_tokens,
            last_counts=self._last_counts,
            update=plan_update,
            shards=shards,
            all_greedy=bool(table.greedy[slots].all()),
            start=decision.start[slots],
            num_tokens=decision.num_tokens[slots].astype(np.int32),
            block_rows=block_rows,
            block_counts=block_counts,
            block_ids=block_ids,
            draft_tokens=draft_tokens,
            draft_counts=draft_counts,
            audit=bool(every) and self._step % every == 0,
        )
        self._last_tokens, self._last_counts = EMPTY, None
        self._plan_slots = slots
        self._last_schedule = decision
        return plan

    def _mark_prompts_ready(self, decision: StepSchedule) -> None:
        """Prefill metrics and prompt readiness: only rows still in (or just done with) their prompt."""
        table = self.scheduler.table
        slots = decision.scheduled
        start, count = decision.start[slots], decision.num_tokens[slots]
        prefill = start + 1 < table.total[slots]
        self.metrics.prefill_tokens += int(count[prefill].sum())
        for slot in slots[prefill | (start < table.prompt_len[slots])].tolist():
            request = table.requests[slot]
            if request.child_index == 0 and decision.start[slot] + decision.num_tokens[slot] >= len(request.prompt_token_ids):
                request.group.prompt_ready = True
                if request.group.owner is None:
                    request.group.owner = request.owner

    def _propose(self, slots: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """N-gram drafts for rows ``slots`` (arrival order), limited so accepting all of them plus a
        bonus stays in bounds, then trimmed by the draft policy (``speculative.draft_policy: adaptive``).
        Returns (drafts per slot, drafts flat)."""
        table = self.scheduler.table
        lefts = table.limit[slots] - table.total[slots]  # min(max_tokens, max_model_len) left
        rooms = np.minimum(lefts, budget + 1) - 1
        critical_only = self.draft_policy is not None and not self.scheduler.waiting
        if critical_only:  # DraftPolicy.critical_rows, on arrays
            critical = lefts >= CRITICAL_SHARE * lefts.max(initial=0)
            rooms = np.where(critical, rooms, 0)
        counts, flat = self._drafts.propose(slots, rooms)
        if critical_only and bool(((counts == 0) & critical).any()):
            return np.zeros(len(slots), np.int32), flat[:0]  # a critical row has nothing to verify: cannot pay
        if self.draft_policy is None:
            return counts, flat
        offsets = offsets_of(counts).tolist()
        flat_list = flat.tolist()
        ids = [table.requests[slot].request_id for slot in slots.tolist()]
        proposals = {rid: flat_list[offsets[i] : offsets[i + 1]] for i, rid in enumerate(ids) if counts[i]}
        chosen = self.draft_policy.choose(proposals, len(slots))
        kept = [chosen.get(rid, []) for rid in ids]
        return (np.array([len(d) for d in kept], dtype=np.int32),
                np.array([t for d in kept for t in d], dtype=np.int32))

    def process(self, plan: StepPlan, results: Sequence[StepResult]) -> list[RequestOutput]:
        """Take the sampled tokens of ``plan``'s step; return outputs of requests that changed."""
        self.accept_step(plan, results)
        return self.take_outputs()

    def accept_step(self, plan: StepPlan, results: Sequence[StepResult]) -> None:
        """Take the sampled tokens of ``plan``'s step and apply stop conditions: all the next plan
        needs. Building outputs (``take_outputs``) can wait until the next step is sent.

        Rows are accepted with array operations: one sampled token each (with per-row checks
        only where a row asks for them: stop ids, stop strings, logprobs), or several (verified
        drafts) for rows without such checks. Only rows that finish and rows with several tokens
        and a per-token check run per-request code."""
        n = plan.batch_size
        if self.draft_policy is not None and bool((plan.num_tokens == 1).all()):
            drafts = plan.draft_counts if plan.draft_counts is not None else EMPTY
            self.draft_policy.observe_step(n + int(drafts.sum()), int(drafts.max(initial=0)),
                                           time.perf_counter() - self._plan_started,
                                           max((r.sample_pass_s for r in results), default=0.0))
        tokens, counts, logprobs = _gather(plan, results)
        table = self.scheduler.table
        slots = self._plan_slots
        if len(slots) != n:
            raise RuntimeError(f"step {plan.step}: results for a plan of {n} rows, {len(slots)} expected")
        now = time.monotonic()
        generated_before = self.metrics.generated_tokens
        computed = plan.start + plan.num_tokens
        live = ~table.done[slots]
        for result in results:  # rows that could not be sampled: their request fails, no one else's
            for row, message in result.errors.items():
                if live[row]:
                    live[row] = False
                    request = table.requests[slots[row]]
                    request.finish(FinishReason.ERROR, error=message)
                    self._finished_row(request)
        samples = computed >= table.total[slots]
        chunk = live & ~samples  # a prefill chunk: its sample is not a token
        table.computed[slots[chunk]] = computed[chunk]
        simple = live & samples
        multi = np.zeros(n, dtype=bool)
        if counts is not None:
            checked = table.stop_ids[slots] | table.stop_text[slots] | table.wants_logprobs[slots]
            multi = simple & (counts > 1) & ~checked
            simple &= counts == 1
        if self.per_row_reference:
            simple[:] = multi[:] = False
        if plan.draft_counts is not None:
            self._count_drafts(plan, slots, live & samples, counts)
        offsets = offsets_of(counts) if counts is not None else np.arange(n + 1)
        accepted_counts = np.zeros(n, dtype=np.int32)
        # -- one token each: arrays, plus per-row checks only where a row asks for them --
        rows = np.flatnonzero(simple)
        s = slots[rows]
        token = tokens[offsets[rows]].astype(np.int64)
        table.computed[s] = computed[rows]
        total = table.total[s] + 1
        table.total[s] = total
        accepted_counts[rows] = 1
        deque(map(list.append, map(table.outputs.__getitem__, s.tolist()), token.tolist()), maxlen=0)
        self.metrics.generated_tokens += len(rows)
        length = total >= table.limit[s]
        eos = ~length & (total >= table.min_total[s]) & (token == table.eos[s])
        stop: dict[int, int | str] = {}  # index into rows -> stop reason (a token id or a string)
        pick = np.flatnonzero(table.stop_ids[s] & ~length & ~eos & (total >= table.min_total[s]))
        for i, slot, tok in zip(pick.tolist(), s[pick].tolist(), token[pick].tolist()):
            if tok in table.requests[slot].params.stop_token_ids:
                stop[i] = tok
        pick = np.flatnonzero(table.wants_logprobs[s])
        for slot, row in zip(s[pick].tolist(), rows[pick].tolist()):
            lps = logprobs.get(row)
            if lps is not None:
                table.logprobs[slot].extend(lps)
        pick = np.flatnonzero(table.stop_text[s])
        produced = total[pick] - table.prompt_len[s[pick]]
        checked = produced > table.min_total[s[pick]] - table.prompt_len[s[pick]]  # past min_tokens
        detokenizers, scanners, byte_table = table.detokenizers, table.stop_scanners, self._token_bytes
        complete = self._complete_utf8
        for i, slot, tok, check in zip(pick.tolist(), s[pick].tolist(), token[pick].tolist(), checked.tolist()):
            scanner = scanners[slot]
            if scanner is None:
                found = detokenizers[slot].push_and_check(tok, check)
            else:
                if not scanner.dirty and complete[tok] and not scanner.may_stop(
                        byte_table, table.outputs[slot], len(byte_table[tok])):
                    continue  # no stop possible: decoding waits until the output is built
                found = self._exact_stop_check(table.requests[slot], detokenizers[slot], scanner)
            if found is not None:
                stop[i] = found
        for i in sorted({*np.flatnonzero(length | eos).tolist(), *stop}):
            request = table.requests[s[i]]
            reason = stop.get(i)
            if isinstance(reason, str):  # a stop string wins over length and EOS, and cuts the text
                request.finish(FinishReason.STOP, stop_reason=reason)
            else:
                request.finish(FinishReason.LENGTH if length[i] else FinishReason.STOP, stop_reason=reason)
                self._finalize_text(request)
            self._finished_row(request)
        for slot in s[total - table.prompt_len[s] == 1].tolist():
            table.requests[slot].first_token_time = now
        self._streamed.extend(map(table.requests.__getitem__, s[table.stream[s]].tolist()))
        multi_rows, multi_accepted = self._accept_several(np.flatnonzero(multi), tokens, counts, offsets,
                                                          computed, now)
        accepted_counts[multi_rows] = multi_accepted
        # -- rows that need per-request code --
        per_row: dict[int, list[int]] = {}
        flat = None
        for r in np.flatnonzero(live & samples & ~simple & ~multi).tolist():
            if flat is None:
                flat = tokens.tolist()
            slot = int(slots[r])
            request = table.requests[slot]
            row_tokens = flat[offsets[r] : offsets[r + 1]]
            table.computed[slot] = computed[r] + len(row_tokens) - 1
            accepted = self._accept(request, row_tokens, logprobs.get(r))
            table.total[slot] = request.num_tokens
            scanner = table.stop_scanners[slot]
            if scanner is not None:
                detok = table.detokenizers[slot]
                scanner.dirty = detok.read_offset < len(detok.tokens)
            self.metrics.generated_tokens += len(accepted)
            if accepted and request.first_token_time is None:
                request.first_token_time = now
            per_row[r] = accepted
            accepted_counts[r] = len(accepted)
            if not request.group.final_only:
                self._pending_outputs[request.group.request_id] = request.group
            if request.finished:
                self._finished_row(request)
        if not per_row and bool(simple.all()):
            self._last_tokens, self._last_counts = token.astype(np.int32), None
        else:
            out = np.zeros(int(accepted_counts.sum()), dtype=np.int32)
            at = offsets_of(accepted_counts)
            out[at[rows]] = token
            if multi_rows.size:
                c = counts[multi_rows]
                row_ix = np.repeat(np.arange(len(multi_rows)), c)
                pos = np.arange(int(c.sum())) - offsets_of(c)[:-1][row_ix]
                keep = pos < multi_accepted[row_ix]
                out[(at[multi_rows][row_ix] + pos)[keep]] = tokens[(offsets[multi_rows][row_ix] + pos)[keep]]
            for r, accepted in per_row.items():
                out[at[r] : at[r] + len(accepted)] = accepted
            self._last_tokens, self._last_counts = out, accepted_counts
        if self._drafts is not None:
            counts_now = self._last_counts if self._last_counts is not None else np.ones(n, dtype=np.int32)
            self._drafts.append(slots, counts_now, self._last_tokens)
        self.metrics.steps += 1
        self.metrics.generation_rate.add(self.metrics.generated_tokens - generated_before, now)

    def _exact_stop_check(self, request: Request, detok: IncrementalDetokenizer, scanner: StopScanner) -> str | None:
        """Push the row's tokens the detokenizer has not seen, checking each as ``_accept`` would;
        only the newest may complete a stop string (the byte scan ruled out the others)."""
        output, min_tokens = request.output_token_ids, request.params.min_tokens
        found = None
        for j in range(detok.consumed, len(output)):
            hit = detok.push_and_check(output[j], j + 1 > min_tokens)
            if hit is not None:
                if j != len(output) - 1:
                    raise RuntimeError(f"request {request.request_id}: stop string {hit!r} completed by a token "
                                       "the byte scan passed over")
                found = hit
        scanner.dirty = detok.read_offset < len(detok.tokens)
        return found

    def _count_drafts(self, plan: StepPlan, slots: np.ndarray, sampled: np.ndarray, counts: np.ndarray | None) -> None:
        """Spec-decode metrics (and the adaptive policy's per-request acceptance) of rows that verified drafts."""
        drafted = sampled & (plan.draft_counts > 0)
        rows = np.flatnonzero(drafted)
        emitted = counts[rows] if counts is not None else np.ones(len(rows), np.int32)
        self.metrics.spec_proposed += int(plan.draft_counts[rows].sum())
        self.metrics.spec_accepted += int((emitted - 1).sum())
        if self.draft_policy is not None:
            table = self.scheduler.table
            for slot, proposed, got in zip(slots[rows].tolist(), plan.draft_counts[rows].tolist(), emitted.tolist()):
                self.draft_policy.observe(table.requests[slot].request_id, proposed, got - 1)

    def _accept_several(self, rows: np.ndarray, tokens: np.ndarray, counts: np.ndarray | None, offsets: np.ndarray,
                        computed: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows that sampled several tokens (verified drafts) and need no per-token check: each
        keeps its tokens up to the first that finishes it. Returns the rows and their accepted counts."""
        if rows.size == 0:
            return rows, rows
        table = self.scheduler.table
        s = self._plan_slots[rows]
        c = counts[rows]
        starts = offsets[rows]
        local = offsets_of(c)[:-1]
        row_ix = np.repeat(np.arange(len(rows)), c)
        pos = np.arange(int(c.sum())) - local[row_ix]
        token = tokens[starts[row_ix] + pos].astype(np.int64)
        before = table.total[s]
        total_at = before[row_ix] + pos + 1
        length = total_at >= table.limit[s][row_ix]
        finishes = length | ((total_at >= table.min_total[s][row_ix]) & (token == table.eos[s][row_ix]))
        first = np.minimum.reduceat(np.where(finishes, pos, len(pos)), local)
        accepted = np.where(first < c, first + 1, c)
        table.computed[s] = computed[rows] + c - 1
        table.total[s] = before + accepted
        flat = tokens.tolist()
        deque(map(list.extend, map(table.outputs.__getitem__, s.tolist()),
                  map(flat.__getitem__, map(slice, starts.tolist(), (starts + accepted).tolist()))), maxlen=0)
        self.metrics.generated_tokens += int(accepted.sum())
        for i in np.flatnonzero(first < c).tolist():
            request = table.requests[s[i]]
            request.finish(FinishReason.LENGTH if length[local[i] + first[i]] else FinishReason.STOP)
            self._finalize_text(request)
            self._finished_row(request)
        for slot in s[before == table.prompt_len[s]].tolist():
            table.requests[slot].first_token_time = now
        self._streamed.extend(map(table.requests.__getitem__, s[table.stream[s]].tolist()))
        return rows, accepted

    def _finished_row(self, request: Request) -> None:
        """A row finished this step: it leaves the batch at the next plan; its output is due."""
        self._mark_done(request)
        self._left(request)
        self._to_remove.append(request.request_id)
        if request.group.finished or not request.group.final_only:
            self._pending_outputs[request.group.request_id] = request.group

    def _mark_done(self, request: Request) -> None:
        if request.slot is not None:
            self.scheduler.table.done[request.slot] = True

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs since the last call; a finished request's final output is delivered once, then forgotten."""
        for request in self._streamed:
            self._pending_outputs[request.group.request_id] = request.group
        self._streamed = []
        outputs = [self._output(g) for g in self._pending_outputs.values()]
        self._pending_outputs = {}
        self._delivered.extend(out.request_id for out in outputs if out.finished)
        return outputs

    def _forget_delivered(self) -> None:
        """Drop finished, delivered requests whose rows have left the batch: a long-lived engine stays flat."""
        if not self._delivered:
            return
        keep = []
        for request_id in self._delivered:
            group = self.requests.get(request_id)
            if group is None or not group.finished:
                continue  # re-used id, running again
            if any(c.slot is not None for c in group.children):  # still holds a row until the next plan
                keep.append(request_id)
                continue
            del self.requests[request_id]
            for child in group.children:
                self.rows.pop(child.request_id, None)
                self.detokenizers.pop(child.request_id, None)
                self._emitted.pop(child.request_id, None)
        self._delivered = keep

    # ----- stop conditions -----

    def _accept(self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> list[int]:
        """Append tokens in order until one finishes the request; later ones are dropped."""
        params = request.params
        detok = self.detokenizers[request.request_id]
        if detok.stop:  # tokens the byte scan let wait (none of them could complete a stop string)
            detok.catch_up(request.output_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.model.max_model_len
        accepted = []
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            accepted.append(token)
            if request.logprobs is not None and logprobs is not None:
                request.logprobs.append(logprobs[i])
            delta = detok.push(token) if detok.stop else ""  # no stop strings: decoded when output
            n = len(request.output_token_ids)
            if n >= max_tokens or len(request.prompt_token_ids) + n >= self.model.max_model_len:
                request.finish(FinishReason.LENGTH)
            elif n >= params.min_tokens:
                if not params.ignore_eos and token == params.eos_token_id:
                    request.finish(FinishReason.STOP)
                elif token in params.stop_token_ids:
                    request.finish(FinishReason.STOP, stop_reason=token)
            if n > params.min_tokens and delta:
                stop = detok.find_stop(len(delta))
                if stop is not None:
                    request.finish(FinishReason.STOP, stop_reason=stop)
                    break
            if request.finished:
                self._finalize_text(request)
                break
        return accepted

    def _finalize_text(self, request: Request) -> None:
        """Emit text still held back for an incomplete character; it may complete a stop string."""
        detok = self.detokenizers.get(request.request_id)
        if detok is None or isinstance(request.stop_reason, str) or not detok.stop:
            return  # without stop strings nothing here depends on the text: it is decoded when output
        detok.catch_up(request.output_token_ids)
        delta = detok.flush()
        stop = detok.find_stop(len(delta)) if delta else None
        if stop is not None:
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop

    def _logprob_dicts(self, request: Request) -> list[PositionLogprobs]:
        """vLLM's shape, converted once per position: the sampled token first, then the top ones."""
        done = request.logprob_dicts
        del done[len(request.logprobs):]
        for lp in request.logprobs[len(done):]:
            position = {lp.sampled_token_id: Logprob(lp.sampled_logprob, lp.sampled_rank,
                                                     self._token_text(lp.sampled_token_id))}
            for rank, (token, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
                position[token] = Logprob(value, rank, self._token_text(token))
            done.append(position)
        return list(done)

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _completion(self, request: Request) -> CompletionOutput:
        detok = self.detokenizers.get(request.request_id)
        if detok is not None:
            detok.catch_up(request.output_token_ids)
            if request.finished and not isinstance(request.stop_reason, str):
                detok.flush()  # an incomplete last character too (idempotent)
        text = detok.visible_text(request.finished) if detok is not None else ""
        sent_chars, sent_tokens = self._emitted[request.request_id]
        self._emitted[request.request_id] = (len(text), len(request.output_token_ids))
        logprobs = self._logprob_dicts(request) if request.logprobs is not None else None
        return CompletionOutput(
            index=request.child_index,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=(sum(lp.sampled_logprob for lp in request.logprobs)
                                if request.logprobs is not None else None),
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            new_text=text[sent_chars:],
            new_token_ids=request.output_token_ids[sent_tokens:],
        )

    def _output(self, group: RequestGroup) -> RequestOutput:
        first = group.children[0]
        errors = [c.error for c in group.children if c.error]
        first_tokens = [c.first_token_time for c in group.children if c.first_token_time is not None]
        return RequestOutput(
            request_id=group.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(c) for c in group.children],
            finished=group.finished,
            error=errors[0] if errors else None,
            retryable=bool(errors) and all(c.retryable for c in group.children if c.error),
            arrival_time=first.arrival_time,
            first_token_time=min(first_tokens) if first_tokens else None,
            finished_time=max(c.finished_time for c in group.children) if group.finished else None,
        )


def _gather(plan: StepPlan, results: Sequence[StepResult]) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """Every worker's tokens in row order: flat tokens, per-row counts (None: one each), logprobs by row."""
    ordered = sorted(results, key=lambda r: r.rows[0])
    at = 0
    for result in ordered:
        lo, hi = result.rows
        if lo != at:
            raise RuntimeError(f"step {plan.step}: no worker returned rows {at}..{lo - 1}")
        at = hi
    if at != plan.batch_size:
        raise RuntimeError(f"step {plan.step}: no worker returned rows {at}..{plan.batch_size - 1}")
    tokens = np.concatenate([r.tokens for r in ordered]) if ordered else EMPTY
    counts = None
    if any(r.counts is not None for r in ordered):
        counts = np.concatenate([r.counts if r.counts is not None else np.ones(r.rows[1] - r.rows[0], np.int32)
                                 for r in ordered])
    logprobs: dict[int, Any] = {}
    for result in ordered:
        logprobs.update(result.logprobs)
    return tokens, counts, logprobs


def _drafts_by_row(decision: StepSchedule, row_of_slot: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
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


def _runs_by_row(runs: dict[int, list[int]], row_of_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-slot lists as (rows ascending, their lengths, the lists concatenated in row order)."""
    if not runs:
        return EMPTY, EMPTY, EMPTY
    pairs = sorted((int(row_of_slot[slot]), values) for slot, values in runs.items())
    rows = np.array([row for row, _ in pairs], dtype=np.int32)
    counts = np.array([len(values) for _, values in pairs], dtype=np.int32)
    flat = np.array([v for _, values in pairs for v in values], dtype=np.int32)
    return rows, counts, flat


def _is_request_level(spec: Any) -> bool:
    processor = getattr(spec, "processor", None)
    return processor == "processors.request_level:RequestLevelAdapter" or processor is RequestLevelAdapter


def coordinator_inputs(config: Any, model_path: str) -> tuple[Any, ModelInfo]:
    """The tokenizer and the model's facts: what the coordinator loads, ready before the workers are."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        config.model.tokenizer or model_path, trust_remote_code=config.model.trust_remote_code
    )
    return tokenizer, ModelInfo.load(model_path, config.model.max_model_len, tokenizer, config.model.trust_remote_code)


def coordinator_from_config(config: Any, model_path: str, num_blocks: int, block_size: int,
                            inputs: tuple[Any, ModelInfo] | None = None) -> Coordinator:
    """Build from a ``RaysampleConfig`` (cluster.config) and the KV blocks each worker holds: no weights."""
    tokenizer, model = inputs if inputs is not None else coordinator_inputs(config, model_path)
    return Coordinator(
        tokenizer,
        model,
        max_num_seqs=config.scheduler.max_num_seqs,
        num_workers=config.cluster.num_workers,
        rows_per_worker=config.scheduler.slots_per_worker(),
        kv=KVSettings(
            num_blocks=num_blocks,
            block_size=block_size,
            prefix_caching=config.cache.enable_prefix_caching,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        ),
        seed=config.scheduler.seed,
        max_logprobs=config.model.max_logprobs,
        custom_processors=config.custom_processors(),
        consistency_check_every=config.scheduler.consistency_check_every,
        default_params=SamplingParams.from_dict(config.defaults),
        drafter=None
        if config.speculative is None
        else NgramDrafter(
            config.speculative.num_speculative_tokens,
            config.speculative.prompt_lookup_min,
            config.speculative.prompt_lookup_max,
        ),
        draft_policy=DraftPolicy() if config.speculative is not None and config.speculative.draft_policy == "adaptive"
        else None,
        reasoning_enabled=config.reasoning is not None,
        processors_from_entry_points=config.processors_from_entry_points,
        grammar_cache_size=config.structured_outputs.grammar_cache_size,
    )

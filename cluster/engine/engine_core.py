"""The engine's core: the coordinator, the executor that runs its plans on the workers, and the outputs
waiting for their callers. As vLLM's ``EngineCore``, one class owns them, and both hosts drive it: the
in-process engine steps it on its caller's thread (``cluster.engine.local_engine``); the Ray coordinator
actor steps it on a thread of its own and adds only that thread and a lock (``cluster.ray.step_loop``).

A step is ``cluster.engine.engine_step.step``. Its outputs, and those of requests that finish without one
(refused, aborted), wait here until polled: one per request, the latest, carrying every delta since the
last poll, so a poller that missed a step loses no text.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from cluster.config import RaysampleConfig
from cluster.engine import engine_step
from cluster.engine.audit import ConsistencyError
from cluster.engine.engine_api import take_ready
from cluster.engine.engine_step import AllWorkersGone, EngineFault, Publish, StepDone
from cluster.engine.executor import Executor, StepFailure, WorkersLost
from cluster.engine.step_profile import StepProfile
from coordinator.coordinator import Coordinator
from coordinator.request import RequestOutput
from processors import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewRequest:
    """One request to add: its prompt and params as given, and what its host found before taking the lock
    (a text prompt's token ids, or why it is refused)."""

    prompt: str | list[int]
    params: SamplingParams | None
    request_id: str | None = None
    token_ids: list[int] | None = None
    rejected: str | None = None

    @classmethod
    def parsed(cls, prompt: Any, params: Any, request_id: str | None,
               tokenize: Callable[[str], list[int]]) -> NewRequest:
        """Params given as a dict parsed and a text prompt tokenized (outside the host's lock: a huge prompt
        stalls no one); what cannot be is the request's own error."""
        rejected, token_ids = None, None
        if isinstance(params, dict):
            try:
                params = SamplingParams.from_dict(params)
            except (ValueError, TypeError) as exc:
                params, rejected = None, f"invalid sampling_params: {exc}"
        if isinstance(prompt, str) and rejected is None:
            try:
                token_ids = tokenize(prompt)
            except ValueError as exc:  # longer than any prompt that fits: refused unread
                rejected = str(exc)
        return cls(prompt, params, request_id, token_ids, rejected)


class Observer(Protocol):
    """What a host reports to (Ray's metrics); every method optional in spirit, all called."""

    def record_finished(self, outputs: list[RequestOutput]) -> None: ...

    def record_step(self, step_s: float, generated: int, prefill: int, proposed: int, accepted: int) -> None: ...

    def record_load(self, running: int, waiting: int, kv_usage: float, rate: float) -> None: ...

    def record_prompt_tokens(self, total: int) -> None: ...


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` with the deltas of ``earlier`` in front: what a poller that missed ``earlier`` needs."""
    for old, new in zip(earlier.outputs, later.outputs):
        new.new_text = old.new_text + new.new_text
        new.new_token_ids = old.new_token_ids + new.new_token_ids
    return later


class EngineCore:
    """Coordinator + executor + the outputs not yet polled; add, abort, step, poll and stats."""

    def __init__(self, config: RaysampleConfig, executor: Executor, coordinator: Coordinator,
                 observer: Observer | None = None, round_trip_s: float = 0.0) -> None:
        self.config, self.executor, self.coordinator, self.observer = config, executor, coordinator, observer
        self.outputs: dict[str, list[RequestOutput]] = {}  # made, not yet polled: one per request
        self.finished: dict[str, int] = {}  # requests by finish reason
        self.fatal: str | None = None  # the engine failed: it takes no more requests
        self.recoveries = 0
        self.step_overhead_ms: deque[float] = deque(maxlen=1000)
        self.profile = StepProfile(round_trip_s=round_trip_s)
        self._started = time.monotonic()

    # ----- requests -----

    def add_requests(self, requests: Sequence[NewRequest], final_only: bool = False) -> list[str]:
        """Admit requests (a refused one finishes at once with its error). ``final_only``: only their final
        outputs are built."""
        if self.fatal is not None:
            raise EngineFault(self.fatal)
        given = [r.request_id for r in requests if r.request_id is not None]
        known = self.coordinator.requests
        in_use = [rid for rid in given if rid in known and not known[rid].finished]
        if len(set(given)) != len(given) or in_use:
            raise ValueError(f"request id(s) {in_use} already in use" if in_use else
                             "request ids within one call must be distinct")
        for rid in given:  # an id a finished request had: its undelivered output would be taken for the new one's
            self.outputs.pop(rid, None)
        with self.coordinator.submitting_together():
            ids = [self.coordinator.add_request(r.prompt, r.params, r.request_id, r.token_ids, r.rejected, final_only)
                   for r in requests]
        self.publish(self.coordinator.take_outputs())
        return ids

    def abort(self, request_id: str) -> bool:
        aborted = self.coordinator.abort(request_id)
        self.publish(self.coordinator.take_outputs())
        return aborted

    def take_ready(self, request_ids: Sequence[str], finished_only: bool = False) -> list[RequestOutput]:
        """The waiting outputs of these requests, removed; KeyError for an id nothing knows (or whose final
        output was delivered already)."""
        ready = take_ready(self.outputs, request_ids, finished_only)
        if not ready:
            known = self.coordinator.requests
            unknown = [rid for rid in request_ids if rid not in known and rid not in self.outputs]
            if unknown:
                raise KeyError(f"unknown request id(s), or their final outputs were already delivered: {unknown}")
        return ready

    def all_finished(self, request_ids: Sequence[str]) -> bool:
        known = self.coordinator.requests
        return all(rid not in known or known[rid].finished for rid in request_ids)

    def drain(self) -> list[RequestOutput]:
        """Every waiting output (what a step made, for a caller that steps the engine itself)."""
        outputs = [out for outs in self.outputs.values() for out in outs]
        self.outputs.clear()
        return outputs

    # ----- the step -----

    def step(self, lock: AbstractContextManager | None = None, overlap_outputs: bool = False,
             publish: Publish | None = None) -> StepDone | StepFailure | None:
        """One step (``engine_step.step``); None when there was nothing to run. An engine fault, or replicas
        that diverged, fail every pending request (retryable) and stop the engine; the error is raised."""
        lock = lock if lock is not None else nullcontext()
        metrics = self.coordinator.metrics
        before = (metrics.generated_tokens, metrics.prefill_tokens, metrics.spec_proposed, metrics.spec_accepted)
        try:
            done = engine_step.step(self.coordinator, self.executor, publish or self.publish, lock, overlap_outputs)
        except (ConsistencyError, EngineFault) as exc:
            with lock:
                self.recoveries += isinstance(exc, AllWorkersGone)
                diverged = isinstance(exc, ConsistencyError)
                self.fail(f"replicas diverged, engine stopped: {exc}" if diverged else str(exc))
            raise
        with lock:
            if done is None:
                self.publish(self.coordinator.take_outputs())  # what finished without a step (grammars, aborts)
                self._report_load()
            elif isinstance(done, WorkersLost):
                self.recoveries += 1
                logger.warning("re-admitted the running requests on workers %s", self.executor.worker_ids)
            elif isinstance(done, StepDone):
                slowest = max((r.timings.compute_s for r in done.results), default=0.0)
                self.step_overhead_ms.append((done.seconds - slowest) * 1000)
                self.profile.add(done.seconds, done.coordinator_cpu_s, done.results)
                self._report_step(done.seconds, before)
        return done

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Keep outputs until polled: one per request, the latest, with every delta since the last poll."""
        if self.observer is not None:
            self.observer.record_finished(outputs)
        for out in outputs:
            if out.finished:
                reason = "error" if out.error else (out.finish_reason.value if out.finish_reason else "unknown")
                self.finished[reason] = self.finished.get(reason, 0) + 1
            earlier = self.outputs.get(out.request_id)
            self.outputs[out.request_id] = [merge_outputs(earlier[0], out) if earlier else out]

    def fail(self, message: str) -> None:
        """Stop serving: every pending request gets ``message`` as its error (retryable)."""
        logger.error("%s", message)
        self.fatal = message
        self.publish(self.coordinator.fail_all(message))

    def _report_step(self, step_s: float, before: tuple[int, int, int, int]) -> None:
        if self.observer is None:
            return
        m = self.coordinator.metrics
        after = (m.generated_tokens, m.prefill_tokens, m.spec_proposed, m.spec_accepted)
        self.observer.record_step(step_s, *(a - b for a, b in zip(after, before)))
        self._report_load()

    def _report_load(self) -> None:
        if self.observer is None:
            return
        c, m = self.coordinator, self.coordinator.metrics
        self.observer.record_prompt_tokens(m.prompt_tokens)
        self.observer.record_load(c.num_running(), c.num_waiting(), c.kv.usage(), m.generation_rate.rate())

    # ----- what it reports -----

    def stats(self) -> dict[str, Any]:
        c, m = self.coordinator, self.coordinator.metrics
        elapsed = max(time.monotonic() - self._started, 1e-9)
        overhead = sorted(self.step_overhead_ms)
        return {
            "running": c.num_running(), "waiting": c.num_waiting(), "workers_alive": len(self.executor.worker_ids),
            "steps": m.steps, "finished": dict(self.finished), "generated_tokens": m.generated_tokens,
            "tokens_per_s": m.generation_rate.rate(),  # the last 10 s
            "tokens_per_s_lifetime": m.generated_tokens / elapsed,
            "spec_proposed": m.spec_proposed, "spec_accepted": m.spec_accepted, "spec_acceptance": m.spec_acceptance,
            "ahead_rows": m.ahead_rows, "ahead_wasted_rows": m.ahead_wasted_rows,
            "step_overhead_ms_median": overhead[len(overhead) // 2] if overhead else None,
            "profile": asdict(self.profile), "recoveries": self.recoveries,
            **c.kv_stats(), "kv_cache": c.kv_summary(),
            "memory_per_worker": self.config.cluster.memory_per_worker,  # Ray memory each worker holds
            # Per worker, per rank of its tensor-parallel group: [weight bytes, KV bytes] held.
            "rank_memory": getattr(self.executor, "rank_memory", None),
            "error": self.fatal,
        }

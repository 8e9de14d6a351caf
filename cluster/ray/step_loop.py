"""The engine on Ray: the step loop on a thread of its own, callers on actor threads.

Runs inside ``CoordinatorActor`` (a plain class so the loop can be read in one
place). Each turn of the loop is ``cluster.engine.engine_step.step`` over a
``RayExecutor``: the same step as the in-process engine. A worker that died or
hung is dropped, the survivors are reset, and every running request is
re-admitted with the tokens it had: prefill of prompt + output, then it goes on;
placement-independent sampling makes the continuation exact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from cluster.background import in_background
from cluster.engine import engine_step
from cluster.engine.audit import ConsistencyError
from cluster.engine.engine_api import take_ready
from cluster.engine.engine_step import AllWorkersGone, EngineFault, StepDone
from cluster.engine.executor import WorkersLost
from cluster.engine.step_profile import StepProfile
from cluster.ray.ray_executor import RayExecutor
from cluster.ray.ray_metrics import EngineRayMetrics
from cluster.startup_heap import freeze_startup_heap
from coordinator.factory import coordinator_from_config, coordinator_inputs
from coordinator.request import RequestOutput
from processors import SamplingParams

logger = logging.getLogger(__name__)

def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` with the deltas of ``earlier`` in front: what a poller that missed ``earlier`` needs."""
    for old, new in zip(earlier.outputs, later.outputs):
        new.new_text = old.new_text + new.new_text
        new.new_token_ids = old.new_token_ids + new.new_token_ids
    return later


class StepLoop:
    # Build and publish step N's outputs while step N+1 runs: None decides from the cores
    # (``_has_spare_core``); bench/step_overhead.py sets it to measure what the overlap saves.
    overlap_outputs: bool | None = None

    def __init__(self, config: Any, placement: Any = None, workers: list[Any] | None = None,
                 kv_note: str | None = None, tokenizer: Any = None) -> None:
        """``placement`` / ``workers``: already launched by the driver (``Engine.start`` does, so the
        workers load while this process starts); else this process launches them. ``kv_note``: where
        the workers' KV budget came from (``cluster.memory``). ``tokenizer``: loaded by the driver
        (``coordinator.factory.shippable_tokenizer``), else loaded here."""
        self.config = config  # resolved by the driver (cluster.config.resolve): nothing here reloads it
        self.timeout_s = self.config.cluster.call_timeout_s
        # The tokenizer loads while the workers load the weights.
        inputs = in_background(coordinator_inputs, self.config, tokenizer, name="raysample-coordinator-inputs")
        self.executor = RayExecutor(self.config, placement, workers)
        num_blocks, block_size = self.executor.start()
        round_trip_s = self.executor.round_trip_s()
        self.coordinator = coordinator_from_config(self.config, num_blocks, block_size, inputs.result())
        self.coordinator.kv_note = kv_note
        self.ray_metrics = EngineRayMetrics(self.config.cluster.coordinator_name,
                                            self.config.model.display_name())
        logger.info("%s", self.coordinator.kv_summary())
        if self.overlap_outputs is None:
            self.overlap_outputs = self.executor.has_spare_core()
        self.lock = threading.Condition()
        self.tokenize_lock = threading.Lock()
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.finished: dict[str, int] = {}  # requests by finish reason
        self.fatal: str | None = None
        self.step_overhead_ms: deque[float] = deque(maxlen=1000)
        self.profile = StepProfile(round_trip_s=round_trip_s)
        self.recoveries = 0
        self._stop = False
        self._started = time.monotonic()
        freeze_startup_heap()  # this actor's process is the engine's own
        self._thread = threading.Thread(target=self._loop, name="raysample-step-loop", daemon=True)
        self._thread.start()

    @property
    def workers(self) -> dict[int, Any]:
        return self.executor.workers

    # ----- requests (called from actor threads) -----

    def ready(self) -> bool:
        return True

    def add_requests(self, items: Sequence[tuple[Any, Any, str | None]], final_only: bool = False) -> list[str]:
        """Admit requests; parameters are parsed and prompts tokenized before the step loop's lock is
        taken, so a huge prompt stalls no one, and a bad item fails alone (its own error output).
        ``final_only``: only their final outputs are built and published."""
        given = [rid for _, _, rid in items if rid is not None]
        if len(set(given)) != len(given):
            raise ValueError("request ids within one call must be distinct")
        prepared = []
        for prompt, params, request_id in items:
            rejected, token_ids = None, None
            if isinstance(params, dict):
                try:
                    params = SamplingParams.from_dict(params)
                except (ValueError, TypeError) as exc:
                    params, rejected = None, f"invalid sampling_params: {exc}"
            if isinstance(prompt, str) and rejected is None:
                with self.tokenize_lock:  # a fast tokenizer must not be entered by two threads at once
                    try:
                        token_ids = self.coordinator.tokenize(prompt)
                    except ValueError as exc:  # longer than any prompt that fits: refused unread
                        rejected = str(exc)
            prepared.append((prompt, params, request_id, token_ids, rejected))
        with self.lock:
            if self.fatal is not None:
                raise RuntimeError(self.fatal)
            in_use = [rid for rid in given if rid in self.coordinator.requests
                      and not self.coordinator.requests[rid].finished]
            if in_use:
                raise ValueError(f"request id(s) {in_use} already in use")
            with self.coordinator.submitting_together():
                ids = [self.coordinator.add_request(prompt, params, request_id, token_ids, rejected, final_only)
                       for prompt, params, request_id, token_ids, rejected in prepared]
            self._publish(self.coordinator.take_outputs())
            self.lock.notify_all()
            return ids

    def abort(self, request_id: str) -> bool:
        with self.lock:
            aborted = self.coordinator.abort(request_id)
            self._publish(self.coordinator.take_outputs())
            return aborted

    def poll(self, request_ids: Sequence[str], timeout_s: float, finished_only: bool = False) -> list[RequestOutput]:
        """Outputs of these requests since the last poll; waits up to ``timeout_s`` for one.

        ``finished_only``: skip intermediate outputs and wake only for final ones,
        so a blocking caller costs one round trip per finished request, not per step.
        """
        wanted = list(request_ids)
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                ready = take_ready(self.outputs, wanted, finished_only)
                if ready:
                    return ready
                known = self.coordinator.requests
                unknown = [rid for rid in wanted if rid not in known and rid not in self.outputs]
                if unknown:
                    raise KeyError(f"unknown request id(s) (or their final output was already delivered): {unknown}")
                if self.fatal is not None and all(r not in known or known[r].finished for r in wanted):
                    raise RuntimeError(self.fatal)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self.lock.wait(remaining)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            m = self.coordinator.metrics
            elapsed = max(time.monotonic() - self._started, 1e-9)
            overhead = sorted(self.step_overhead_ms)
            return {
                "running": self.coordinator.num_running(),
                "waiting": self.coordinator.num_waiting(),
                "workers_alive": len(self.workers),
                "steps": m.steps,
                "finished": dict(self.finished),
                "generated_tokens": m.generated_tokens,
                "tokens_per_s": m.generation_rate.rate(),  # the last 10 s
                "tokens_per_s_lifetime": m.generated_tokens / elapsed,
                "spec_proposed": m.spec_proposed,
                "spec_accepted": m.spec_accepted,
                "spec_acceptance": m.spec_acceptance,
                "ahead_rows": m.ahead_rows,
                "ahead_wasted_rows": m.ahead_wasted_rows,
                "step_overhead_ms_median": overhead[len(overhead) // 2] if overhead else None,
                "profile": asdict(self.profile),
                "recoveries": self.recoveries,
                "overlap_outputs": self.overlap_outputs,
                **self.coordinator.kv_stats(),
                "kv_cache": self.coordinator.kv_summary(),
                "memory_per_worker": self.config.cluster.memory_per_worker,  # Ray memory each worker holds
                # Per worker, per rank of its tensor-parallel group: [weight bytes, KV bytes] held.
                "rank_memory": getattr(self.executor, "rank_memory", None),
                "error": self.fatal,
            }

    def worker_handles(self) -> list[Any]:
        return list(self.executor.workers.values())

    def shutdown(self) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        self._thread.join(timeout=self.timeout_s)
        self.executor.shutdown()

    # ----- the loop -----

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Buffer outputs until polled: one per request, the latest, carrying every delta since the last poll."""
        self.ray_metrics.record_finished(outputs)
        for out in outputs:
            if out.finished:
                reason = "error" if out.error else (out.finish_reason.value if out.finish_reason else "unknown")
                self.finished[reason] = self.finished.get(reason, 0) + 1
            earlier = self.outputs.get(out.request_id)
            self.outputs[out.request_id] = [merge_outputs(earlier[0], out) if earlier else out]
        if outputs:
            self.lock.notify_all()

    def _loop(self) -> None:
        """Step while there is work; step N's outputs (detokenization included) are built while the
        workers compute step N+1 when ``overlap_outputs``, else before planning."""
        while True:
            with self.lock:
                if self._stop:
                    return
                m = self.coordinator.metrics
                before = (m.generated_tokens, m.prefill_tokens, m.spec_proposed, m.spec_accepted)
                if self.fatal is not None:
                    self._idle()
                    continue
            try:
                done = engine_step.step(self.coordinator, self.executor, self._publish, self.lock,
                                        self.overlap_outputs)
            except (ConsistencyError, EngineFault) as exc:
                with self.lock:
                    self.recoveries += isinstance(exc, AllWorkersGone)
                    diverged = isinstance(exc, ConsistencyError)
                    self._fail(f"replicas diverged, engine stopped: {exc}" if diverged else str(exc))
                continue
            with self.lock:
                if done is None:
                    self._idle()
                elif isinstance(done, WorkersLost):
                    self.recoveries += 1
                    logger.warning("re-admitted the running requests on workers %s", self.executor.worker_ids)
                elif isinstance(done, StepDone):
                    slowest = max((r.compute_s for r in done.results), default=0.0)
                    self.step_overhead_ms.append((done.seconds - slowest) * 1000)
                    self.profile.add(done.seconds, done.coordinator_cpu_s, done.results)
                    self._record_step(done.seconds, before)

    def _idle(self) -> None:
        """Nothing to run: publish what is due (errors, aborts) and wait a little for requests."""
        c, m = self.coordinator, self.coordinator.metrics
        self._publish(c.take_outputs())
        self.ray_metrics.record_load(c.num_running(), c.num_waiting(), c.kv.usage(), m.generation_rate.rate())
        self.ray_metrics.record_prompt_tokens(m.prompt_tokens)
        self.lock.wait(0.05)

    def _record_step(self, step_s: float, before: tuple[int, int, int, int]) -> None:
        m, c = self.coordinator.metrics, self.coordinator
        after = (m.generated_tokens, m.prefill_tokens, m.spec_proposed, m.spec_accepted)
        self.ray_metrics.record_step(step_s, *(a - b for a, b in zip(after, before)))
        self.ray_metrics.record_prompt_tokens(m.prompt_tokens)
        self.ray_metrics.record_load(c.num_running(), c.num_waiting(), c.kv.usage(), m.generation_rate.rate())

    def _fail(self, message: str) -> None:
        """Stop serving: every pending request gets ``message`` as its error."""
        logger.error("%s", message)
        self.fatal = message
        self._publish(self.coordinator.fail_all(message))

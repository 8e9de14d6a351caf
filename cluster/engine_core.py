"""The distributed step loop: one coordinator, worker actors, audit and fault tolerance.

Runs inside ``CoordinatorActor`` (a plain class so the loop can be read in
one place). Every step sends one plan (put in the object store once) to every
live worker and waits for all of them with a timeout. A worker that died or
hung is dropped, the survivors are reset, and every running request is
re-admitted with the tokens it had: prefill of prompt + output, then it goes
on; placement-independent sampling makes the continuation exact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import ray

from cluster.audit import ConsistencyError, check_consistency
from cluster.background import in_background
from cluster.config import load_config
from cluster.engine_api import take_ready
from cluster.ray_metrics import EngineRayMetrics
from cluster.ray_cluster import create_worker_placement, launch_worker
from cluster.step_profile import StepProfile
from coordinator.coordinator import coordinator_from_config, coordinator_inputs
from workers.wire import StepPlan, StepResult
from coordinator.request import RequestOutput
from processors import SamplingParams

logger = logging.getLogger(__name__)

_WORKER_GONE = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` with the deltas of ``earlier`` in front: what a poller that missed ``earlier`` needs."""
    for old, new in zip(earlier.outputs, later.outputs):
        new.new_text = old.new_text + new.new_text
        new.new_token_ids = old.new_token_ids + new.new_token_ids
    return later


class EngineCore:
    # Build and publish step N's outputs while step N+1 runs: None decides from the cores
    # (``_has_spare_core``); bench/step_overhead.py sets it to measure what the overlap saves.
    overlap_outputs: bool | None = None

    def __init__(self, config: dict[str, Any], placement: Any = None, workers: list[Any] | None = None,
                 kv_note: str | None = None) -> None:
        """``placement`` / ``workers``: already launched by the driver (``Engine.from_config`` does, so the
        workers load while this process starts); else this process launches them. ``kv_note``: where
        the workers' KV budget came from (``cluster.memory``)."""
        self.config = load_config(config)
        self.timeout_s = self.config.cluster.call_timeout_s
        model_path = self.config.model.resolve_path()
        # The tokenizer and model facts load while the workers load the weights.
        inputs = in_background(coordinator_inputs, self.config, model_path, name="raysample-coordinator-inputs")
        self.placement = placement if placement is not None else create_worker_placement(self.config, self.timeout_s)
        launched = dict(enumerate(workers)) if workers is not None else {
            i: self._new_worker(i) for i in range(self.config.cluster.num_workers)}
        self.workers, (num_blocks, block_size) = self._start_workers(launched)
        self.kv_shape = (num_blocks, block_size)
        self.replacements = 0
        self.coordinator = coordinator_from_config(self.config, model_path, num_blocks, block_size, inputs.result())
        self.coordinator.kv_note = kv_note
        self.ray_metrics = EngineRayMetrics(self.config.cluster.coordinator_name,
                                            self.config.model.display_name())
        logger.info("%s", self.coordinator.kv_summary())
        self._graph: Any = None  # compiled graph over the live workers, when enabled
        if self.overlap_outputs is None:
            self.overlap_outputs = self._has_spare_core()
        self._compile()
        self.lock = threading.Condition()
        self.tokenize_lock = threading.Lock()
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.finished: dict[str, int] = {}  # requests by finish reason
        self.fatal: str | None = None
        self.step_overhead_ms: deque[float] = deque(maxlen=1000)
        self.profile = StepProfile()
        self.recoveries = 0
        self._stop = False
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="raysample-step-loop", daemon=True)
        self._thread.start()

    def _start_workers(self, workers: dict[int, Any]) -> tuple[dict[int, Any], tuple[int, int]]:
        """The launched workers once loaded, and the KV blocks every one of them holds."""
        infos = ray.get([w.info.remote() for w in workers.values()], timeout=self.config.cluster.startup_timeout_s)
        logger.info("raysample workers ready: %s", ", ".join(f"{i.device} ({i.num_blocks} KV blocks)" for i in infos))
        sizes = {i.block_size for i in infos}
        if len(sizes) != 1:  # CPU and GPU workers mixed without cache.block_size
            raise ValueError(f"workers chose different KV block sizes {sorted(sizes)}; set cache.block_size")
        return workers, (min(i.num_blocks for i in infos), sizes.pop())

    def _has_spare_core(self) -> bool:
        """Whether this node has a core that no CPU worker's threads use.

        Overlapping the coordinator's output building with the step pays only there: on a node whose
        cores the workers' threads fill, it slows their compute more than it saves (bench/step_overhead.py,
        2 cores, one worker with 2 threads: 0.84-0.89x). GPU workers compute on the device.
        """
        cluster = self.config.cluster
        if cluster.gpus_per_worker > 0 or self.config.model.simulate is not None:
            return True  # simulated workers stand for GPU ones: they sleep, their cores are free
        from workers.threads import threads_for_share, usable_cores

        here = ray.get_runtime_context().get_node_id()
        nodes = ray.util.placement_group_table(self.placement)["bundles_to_node_id"].values()
        local_workers = sum(1 for node in nodes if node == here)
        return usable_cores() - local_workers * threads_for_share(cluster.cpus_per_worker) >= 1

    def _new_worker(self, index: int) -> Any:
        return launch_worker(self.config, self.placement, index)

    def _replace(self, gone: list[int], counted: bool = True) -> dict[int, Any]:
        """New workers for dead or hung ones, on the same bundles, while the budget lasts.

        ``counted=False``: the engine was running suspects apart (``coordinator.quarantine``), so the
        failure was a request's doing, not the workers': it does not use up the budget."""
        budget = self.config.cluster.max_worker_replacements - self.replacements if counted else len(gone)
        if len(gone) > budget:
            logger.warning("workers %s are not replaced: cluster.max_worker_replacements=%d reached",
                           gone[budget:], self.config.cluster.max_worker_replacements)
        started = {i: self._new_worker(i) for i in gone[:max(budget, 0)]}
        self.replacements += len(started) if counted else 0
        fresh: dict[int, Any] = {}
        deadline = time.monotonic() + self.config.cluster.startup_timeout_s
        for i, worker in started.items():  # they load in parallel, within one start-up timeout
            try:
                info = ray.get(worker.info.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # could not start (no resources, node gone): go on without it
                logger.warning("replacement for worker %d did not start (%s)", i, type(exc).__name__)
                ray.kill(worker, no_restart=True)
                continue
            if info.block_size != self.kv_shape[1] or info.num_blocks < self.kv_shape[0]:
                logger.warning("replacement for worker %d has a smaller KV cache; not used", i)
                ray.kill(worker, no_restart=True)
                continue
            logger.warning("worker %d replaced", i)
            fresh[i] = worker
        return fresh

    def _compile(self) -> None:
        """One compiled graph (shared-memory channels) for the per-step fan-out, when enabled."""
        self._teardown()
        if not self.config.cluster.use_compiled_graph() or not self.workers:
            return
        from ray.dag import InputNode, MultiOutputNode
        from ray.dag.context import DAGContext

        context = DAGContext.get_current()  # a step may take up to call_timeout_s, not Ray's 10 s default
        context.get_timeout = max(context.get_timeout, int(self.timeout_s + 0.999))
        try:
            with InputNode() as plan:
                dag = MultiOutputNode([w.step.bind(plan) for w in self.workers.values()])
            self._graph = dag.experimental_compile()
        except Exception as exc:  # not available here: plain actor calls still work
            logger.warning("compiled graph unavailable (%s); using plain actor calls", exc)
            self._graph = None

    def _teardown(self, kill_actors: bool = False) -> None:
        """Tear the compiled graph down, waiting at most ``call_timeout_s``: a hung actor must not hang us."""
        graph, self._graph = self._graph, None
        if graph is None:
            return

        def run() -> None:
            try:
                graph.teardown(kill_actors=kill_actors)
            except Exception as exc:
                logger.warning("compiled graph teardown: %s", exc)

        thread = threading.Thread(target=run, name="raysample-graph-teardown", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            logger.warning("compiled graph teardown still running after %.0fs; going on without it", self.timeout_s)

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
                "step_overhead_ms_median": overhead[len(overhead) // 2] if overhead else None,
                "profile": asdict(self.profile),
                "recoveries": self.recoveries,
                "overlap_outputs": self.overlap_outputs,
                **self.coordinator.kv_stats(),
                "kv_cache": self.coordinator.kv_summary(),
                "memory_per_worker": self.config.cluster.memory_per_worker,  # Ray memory each worker holds
                "error": self.fatal,
            }

    def worker_handles(self) -> list[Any]:
        return list(self.workers.values())

    def shutdown(self) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        self._thread.join(timeout=self.timeout_s)
        self._teardown()
        for worker in self.workers.values():
            ray.kill(worker)
        ray.util.remove_placement_group(self.placement)

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
        """Plan step N+1 as soon as step N's tokens are in and send it; step N's outputs
        (detokenization included) are built while the workers compute when ``overlap_outputs``,
        else before planning."""
        while True:
            with self.lock:
                if self._stop:
                    return
                started, started_cpu = time.perf_counter(), time.thread_time()
                m = self.coordinator.metrics
                before = (m.generated_tokens, m.prefill_tokens, m.spec_proposed, m.spec_accepted)
                plan = self.coordinator.next_plan() if self.fatal is None else None
                if plan is None:
                    self._publish(self.coordinator.take_outputs())
                    c = self.coordinator
                    self.ray_metrics.record_load(c.num_running(), c.num_waiting(), c.kv.usage(), m.generation_rate.rate())
                    self.lock.wait(0.05)
                    continue
            pending = self._submit(plan)
            planned_cpu = time.thread_time()
            if self.overlap_outputs:
                with self.lock:  # while the workers compute
                    self._publish(self.coordinator.take_outputs())
            overlapped_cpu = time.thread_time() - planned_cpu
            results = self._collect(plan, pending)
            with self.lock:
                if results is None:
                    continue
                try:
                    if plan.audit:
                        check_consistency(plan.step, results)
                except ConsistencyError as exc:
                    self._fail(f"replicas diverged, engine stopped: {exc}")
                    continue
                self.coordinator.accept_step(plan, results)
                if not self.overlap_outputs:
                    self._publish(self.coordinator.take_outputs())
                step_s = time.perf_counter() - started
                slowest = max((r.compute_s for r in results), default=0.0)
                self.step_overhead_ms.append((step_s - slowest) * 1000)
                self.profile.add(step_s, time.thread_time() - started_cpu - overlapped_cpu, results)
                self._record_step(step_s, before)

    def _record_step(self, step_s: float, before: tuple[int, int, int, int]) -> None:
        m, c = self.coordinator.metrics, self.coordinator
        after = (m.generated_tokens, m.prefill_tokens, m.spec_proposed, m.spec_accepted)
        self.ray_metrics.record_step(step_s, *(a - b for a, b in zip(after, before)))
        self.ray_metrics.record_load(c.num_running(), c.num_waiting(), c.kv.usage(), m.generation_rate.rate())

    def _submit(self, plan: StepPlan) -> Any:
        """Start the step on every live worker without waiting: refs, or the error that stopped it."""
        try:
            if self._graph is not None:
                return self._graph.execute(plan)  # one write to a channel every worker reads
            shared = ray.put(plan)  # serialized once, not once per worker; each node fetches it once
            return {i: w.step.remote(shared) for i, w in self.workers.items()}
        except Exception as exc:  # the compiled graph is broken (a worker died between steps)
            return exc

    def _collect(self, plan: StepPlan, pending: Any) -> list[StepResult] | None:
        """The step's results, or None after handling a failure (recovery or failed requests)."""
        if self._graph is not None or isinstance(pending, Exception):
            return self._collect_compiled(plan, pending)
        deadline = time.monotonic() + self.timeout_s
        try:  # one call for every result: the common case costs the coordinator half the CPU of W calls
            return list(ray.get(list(pending.values()), timeout=self.timeout_s))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # find who failed, one by one (a hung one has used up the deadline already)
        results, gone, raised, hung = [], [], [], False
        for i, ref in pending.items():
            try:
                results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except _WORKER_GONE as exc:
                logger.warning("worker %d is gone (%s)", i, type(exc).__name__)
                gone.append(i)
                hung |= isinstance(exc, ray.exceptions.GetTimeoutError)
            except ray.exceptions.RayTaskError as exc:
                raised.append(getattr(exc, "cause", exc))
        if gone:
            self._recover(gone, f"hung (no answer in {self.timeout_s:.0f}s)" if hung else "died")
            return None
        if raised:
            self._fail_step(raised[0])
            return None
        return results

    def _collect_compiled(self, plan: StepPlan, pending: Any) -> list[StepResult] | None:
        try:
            if isinstance(pending, Exception):
                raise pending
            return list(ray.get(pending, timeout=self.timeout_s))
        except ray.exceptions.RayTaskError as exc:
            self._fail_step(getattr(exc, "cause", exc))
            return None
        except Exception as exc:  # a worker died or hung: the graph is broken
            hung = isinstance(exc, (ray.exceptions.GetTimeoutError, ray.exceptions.RayChannelTimeoutError))
            logger.warning("step %d failed (%s: %s); checking workers", plan.step, type(exc).__name__,
                           str(exc).splitlines()[0] if str(exc) else "")
            if hung:
                # Which actor hangs cannot be asked while the graph runs: stop all of them; they are replaced.
                self._teardown(kill_actors=True)
                gone = list(self.workers)
            else:
                self._teardown()
                gone = [i for i, w in self.workers.items() if not self._alive(w)]
            self._recover(gone, f"hung (no answer in {self.timeout_s:.0f}s)" if hung else "died")
            return None

    def _alive(self, worker: Any) -> bool:
        try:
            ray.get(worker.ready.remote(), timeout=min(10.0, self.timeout_s))
            return True
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False

    def _recover(self, gone: list[int], cause: str) -> None:
        """Drop dead or hung workers, start replacements, reset the others, re-admit every running
        request; the requests the lost workers held are suspects (``coordinator.quarantine``)."""
        with self.lock:
            probing = self.coordinator.worker_failed(gone, cause, [i for i in self.workers if i not in gone])
        for i in gone:
            ray.kill(self.workers.pop(i), no_restart=True)
        survivors = dict(self.workers)
        try:
            ray.get([w.reset.remote() for w in survivors.values()], timeout=self.timeout_s)
        except _WORKER_GONE:
            # Someone else died meanwhile: find out who and start over.
            alive = {}
            for i, w in survivors.items():
                try:
                    ray.get(w.reset.remote(), timeout=self.timeout_s)
                    alive[i] = w
                except _WORKER_GONE:
                    ray.kill(w, no_restart=True)
                    gone.append(i)
            self.workers = alive
        self.workers.update(self._replace(sorted(set(gone)), counted=not probing))
        self.workers = dict(sorted(self.workers.items()))
        with self.lock:
            self.recoveries += 1
            if not self.workers:
                self._fail("all raysample workers are gone; pending requests cannot be served")
                return
            self._compile()
            self.coordinator.scheduler.set_workers(list(self.workers))
            self._publish(self.coordinator.take_outputs())
            logger.warning("re-admitted the running requests on workers %s", sorted(self.workers))

    def _fail_step(self, cause: BaseException) -> None:
        """A worker raised (a processor, the sampler, the model): fail the requests that enable it when
        known, else make the step's requests suspects (``coordinator.quarantine``); reset the workers
        and re-admit the others; the engine keeps serving."""
        with self.lock:
            self.coordinator.fail_step(getattr(cause, "rows", None), f"step failed: {cause}", list(self.workers))
            self._publish(self.coordinator.take_outputs())
        self._teardown()
        ray.get([w.reset.remote() for w in self.workers.values()], timeout=self.timeout_s)
        self._compile()

    def _fail(self, message: str) -> None:
        """Stop serving: every pending request gets ``message`` as its error."""
        logger.error("%s", message)
        self.fatal = message
        self._publish(self.coordinator.fail_all(message))

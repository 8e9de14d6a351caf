"""Steps on worker actors: one plan put in the object store once (or written to a compiled
graph's channel), every live worker's result collected with a timeout, lost workers replaced."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from cluster.config import RaysampleConfig
from cluster.engine.executor import Executor, StepFailure, StepRaised, WorkersLost
from cluster.ray.ray_cluster import create_worker_placement, launch_worker
from workers.wire import StepPlan, StepResult

logger = logging.getLogger(__name__)

_WORKER_GONE = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)


def _raised(cause: BaseException) -> StepRaised:
    return StepRaised(getattr(cause, "rows", None), str(cause))


class RayExecutor(Executor):
    def __init__(self, config: RaysampleConfig, placement: Any = None, workers: list[Any] | None = None) -> None:
        """``placement`` / ``workers``: already launched by the driver (``Engine.start`` does, so the
        workers load while the coordinator's process starts); else launched here."""
        self.config = config
        self.timeout_s = config.cluster.call_timeout_s
        self.placement = placement if placement is not None else create_worker_placement(config, self.timeout_s)
        launched = dict(enumerate(workers)) if workers is not None else {
            i: launch_worker(config, self.placement, i) for i in range(config.cluster.num_workers)}
        self.workers: dict[int, Any] = launched
        self.replacements = 0
        self._graph: Any = None  # compiled graph over the live workers, when enabled

    def start(self) -> tuple[int, int]:
        """Wait for the launched workers to load; the KV blocks every one of them holds, and their size."""
        infos = ray.get([w.info.remote() for w in self.workers.values()],
                        timeout=self.config.cluster.startup_timeout_s)
        logger.info("raysample workers ready: %s", ", ".join(f"{i.device} ({i.num_blocks} KV blocks)" for i in infos))
        # Per rank of each worker's tensor-parallel group: (weight bytes, KV bytes) it holds.
        self.rank_memory = [list(zip(i.weight_bytes, i.kv_bytes)) for i in infos]
        if self.config.model.tensor_parallel_size > 1:
            logger.info("per rank: %s", "; ".join(
                ", ".join(f"{w / 2**20:.1f} MiB weights + {k / 2**20:.1f} MiB KV" for w, k in ranks)
                for ranks in self.rank_memory))
        sizes = {i.block_size for i in infos}
        if len(sizes) != 1:  # CPU and GPU workers mixed without cache.block_size
            raise ValueError(f"workers chose different KV block sizes {sorted(sizes)}; set cache.block_size")
        self.kv_shape = (min(i.num_blocks for i in infos), sizes.pop())
        self._compile()
        return self.kv_shape

    @property
    def worker_ids(self) -> list[int]:
        return sorted(self.workers)

    def round_trip_s(self, calls: int = 20) -> float:
        """Median seconds of an idle call to the first worker and back (the step profile's transport)."""
        worker = self.workers[self.worker_ids[0]]
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            ray.get(worker.ready.remote(), timeout=self.timeout_s)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def has_spare_core(self) -> bool:
        """Whether this node has a core that no CPU worker's threads use.

        Overlapping the coordinator's output building with the step pays only there: on a node whose
        cores the workers' threads fill, it slows their compute more than it saves (bench/step_overhead.py,
        2 cores, one worker with 2 threads: 0.84-0.89x). GPU workers compute on the device.
        """
        cluster = self.config.cluster
        if cluster.gpus_per_worker > 0 or self.config.model.simulate is not None:
            return True  # simulated workers stand for GPU ones: they sleep, their cores are free
        from workers.step.threads import threads_for_share, usable_cores

        here = ray.get_runtime_context().get_node_id()
        nodes = ray.util.placement_group_table(self.placement)["bundles_to_node_id"].values()
        local_workers = sum(1 for node in nodes if node == here)
        return usable_cores() - local_workers * threads_for_share(cluster.cpus_per_worker) >= 1

    # ----- one step -----

    def launch(self, plan: StepPlan) -> Any:
        """Refs, the compiled graph's future, or the error that stopped the launch."""
        try:
            if self._graph is not None:
                return self._graph.execute(plan)  # one write to a channel every worker reads
            shared = ray.put(plan)  # serialized once, not once per worker; each node fetches it once
            return {i: w.step.remote(shared) for i, w in self.workers.items()}
        except Exception as exc:  # the compiled graph is broken (a worker died between steps)
            return exc

    def collect(self, plan: StepPlan, pending: Any) -> list[StepResult] | StepFailure:
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
            return WorkersLost(gone, self._cause(hung))
        if raised:
            return _raised(raised[0])
        return results

    def _collect_compiled(self, plan: StepPlan, pending: Any) -> list[StepResult] | StepFailure:
        try:
            if isinstance(pending, Exception):
                raise pending
            return list(ray.get(pending, timeout=self.timeout_s))
        except ray.exceptions.RayTaskError as exc:
            return _raised(getattr(exc, "cause", exc))
        except Exception as exc:  # a worker died or hung: the graph is broken
            hung = isinstance(exc, (ray.exceptions.GetTimeoutError, ray.exceptions.RayChannelTimeoutError))
            logger.warning("step %d failed (%s: %s); checking workers", plan.step, type(exc).__name__,
                           str(exc).splitlines()[0] if str(exc) else "")
            if hung:
                # Which actor hangs cannot be asked while the graph runs: stop all of them; they are replaced.
                # Killed before the teardown: it would wait out the hung actor's loop, call_timeout_s more.
                for worker in self.workers.values():
                    ray.kill(worker, no_restart=True)
                self._teardown(actors_killed=True)
                return WorkersLost(list(self.workers), self._cause(hung))
            self._teardown()
            return WorkersLost([i for i, w in self.workers.items() if not self._alive(w)], self._cause(hung))

    def _cause(self, hung: bool) -> str:
        return f"hung (no answer in {self.timeout_s:.0f}s)" if hung else "died"

    def _alive(self, worker: Any) -> bool:
        try:
            ray.get(worker.ready.remote(), timeout=min(10.0, self.timeout_s))
            return True
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False

    # ----- failures -----

    def replace(self, lost: Sequence[int], counted: bool) -> None:
        gone = list(lost)
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
        self.workers.update(self._start_replacements(sorted(set(gone)), counted))
        self.workers = dict(sorted(self.workers.items()))
        if self.workers:
            self._compile()

    def _start_replacements(self, gone: list[int], counted: bool) -> dict[int, Any]:
        """New workers for dead or hung ones, on the same bundles, while the budget lasts."""
        budget = self.config.cluster.max_worker_replacements - self.replacements if counted else len(gone)
        if len(gone) > budget:
            logger.warning("workers %s are not replaced: cluster.max_worker_replacements=%d reached",
                           gone[budget:], self.config.cluster.max_worker_replacements)
        started = {i: launch_worker(self.config, self.placement, i) for i in gone[:max(budget, 0)]}
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

    def reset(self) -> None:
        self._teardown()
        ray.get([w.reset.remote() for w in self.workers.values()], timeout=self.timeout_s)
        self._compile()

    def self_check(self) -> str | None:
        self._teardown()  # a compiled graph's actors run its loop: plain calls wait behind it
        try:
            for i, worker in self.workers.items():
                try:
                    problem = ray.get(worker.self_check.remote(), timeout=self.timeout_s)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    problem = f"it failed to compute a fixed probe ({type(exc).__name__}: {first})"
                if problem is not None:
                    return f"worker {i}: {problem}"
            return None
        finally:
            self._compile()

    # ----- the compiled graph -----

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

    def _teardown(self, actors_killed: bool = False) -> None:
        """Tear the compiled graph down, waiting at most ``call_timeout_s``: a hung actor must not hang us.
        ``actors_killed``: its actors were killed first, so Ray's errors at cancelling their loops (a
        traceback per actor) say nothing new and are not logged."""
        graph, self._graph = self._graph, None
        if graph is None:
            return

        def run() -> None:
            try:
                graph.teardown()
            except Exception as exc:
                if not actors_killed:
                    logger.warning("compiled graph teardown: %s", exc)

        ray_dag_log = logging.getLogger("ray.dag")
        level = ray_dag_log.level
        if actors_killed:
            ray_dag_log.setLevel(logging.CRITICAL)
        thread = threading.Thread(target=run, name="raysample-graph-teardown", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        ray_dag_log.setLevel(level)
        if thread.is_alive():
            logger.warning("compiled graph teardown still running after %.0fs; going on without it", self.timeout_s)

    def shutdown(self) -> None:
        self._teardown()
        for worker in self.workers.values():
            ray.kill(worker)
        ray.util.remove_placement_group(self.placement)

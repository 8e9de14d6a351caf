"""Steps on workers that are plain objects in this process, one after another.

The step runs on a daemon thread of its own, so a call that never returns (a processor
stuck for one request) ends the wait after ``cluster.call_timeout_s`` as it does on
Ray. A Python thread cannot be killed: the stuck one is abandoned with the worker it
holds, and told not to touch any other worker when it wakes; so is the compute thread
(``workers.step.compute_thread``) the stuck call may hold, and replacements load on a new one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from cluster.background import SerialThread
from cluster.config import RaysampleConfig
from cluster.engine.executor import Executor, StepFailure, StepRaised, WorkersLost
from workers.sample.sampler_errors import LogitsProcessorError
from workers.step.compute_thread import abandon_compute_thread
from workers.step.worker import Worker
from workers.wire import StepPlan, StepResult

logger = logging.getLogger(__name__)


def local_device(config: RaysampleConfig, worker_id: int) -> torch.device:
    """A GPU when the config asks for one; asking for one that this process cannot see is an error."""
    if config.cluster.gpus_per_worker > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"cluster.gpus_per_worker={config.cluster.gpus_per_worker} but no GPU is visible "
                               "to this process; set it to 0 to run on CPU")
        return torch.device("cuda", worker_id % torch.cuda.device_count())
    return torch.device("cpu")


class InProcessExecutor(Executor):
    def __init__(self, make_worker: Callable[[int], Worker], num_workers: int, timeout_s: float,
                 max_replacements: int) -> None:
        """``make_worker(i)``: worker ``i`` on its device, loaded (also used for replacements)."""
        self.make_worker = make_worker
        self.workers: dict[int, Worker] = {i: make_worker(i) for i in range(num_workers)}
        self.timeout_s = timeout_s
        self.max_replacements = max_replacements
        self.replacements = 0
        self._new_thread()

    def _new_thread(self) -> None:
        self._pool = SerialThread("raysample-local-step")
        self._cancelled = threading.Event()
        self._current = -1

    @property
    def worker_ids(self) -> list[int]:
        return sorted(self.workers)

    def launch(self, plan: StepPlan) -> Future:
        workers, cancelled = list(self.workers.items()), self._cancelled

        def steps() -> list[StepResult]:
            results = []
            for i, worker in workers:
                if cancelled.is_set():
                    return results
                self._current = i
                results.append(worker.step(plan))
            return results

        return self._pool.submit(steps)

    def collect(self, plan: StepPlan, pending: Future) -> list[StepResult] | StepFailure:
        try:
            return pending.result(timeout=self.timeout_s)
        except FutureTimeout:  # a worker's call never returned: abandon its thread
            hung = self._current
            self._cancelled.set()
            self._pool.stop()
            self._new_thread()
            abandon_compute_thread()
            return WorkersLost([hung], f"hung (no answer in {self.timeout_s:.0f}s)")
        except Exception as exc:  # a processor, the sampler or the model raised
            if isinstance(exc, LogitsProcessorError):
                return StepRaised(exc.rows, str(exc))
            return StepRaised(None, f"{type(exc).__name__}: {exc}")

    def replace(self, lost: Sequence[int], counted: bool) -> None:
        for i in lost:
            del self.workers[i]
        self.reset()
        for i in lost:
            if counted and self.replacements >= self.max_replacements:
                logger.warning("worker %d is not replaced: cluster.max_worker_replacements=%d reached",
                               i, self.max_replacements)
                continue
            self.replacements += counted
            logger.warning("worker %d hung; replacing it", i)
            self.workers[i] = self.make_worker(i)
        self.workers = dict(sorted(self.workers.items()))

    def reset(self) -> None:
        for worker in self.workers.values():
            worker.reset()

    def self_check(self) -> str | None:
        def check() -> str | None:
            for i, worker in self.workers.items():
                problem = worker.self_check()
                if problem is not None:
                    return f"worker {i}: {problem}"
            return None

        try:
            return self._pool.submit(check).result(timeout=self.timeout_s)
        except FutureTimeout:
            self._cancelled.set()
            self._pool.stop()
            self._new_thread()
            abandon_compute_thread()
            return f"a worker hung (no answer in {self.timeout_s:.0f}s) computing a fixed probe"
        except Exception as exc:  # noqa: BLE001
            return f"a worker failed to compute a fixed probe ({type(exc).__name__}: {exc})"

    def shutdown(self) -> None:
        self._pool.stop()
        for worker in self.workers.values():
            worker.shutdown()

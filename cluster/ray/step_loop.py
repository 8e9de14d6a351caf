"""The engine on Ray: its ``EngineCore`` stepped on a thread of its own inside ``CoordinatorActor``, callers on
actor threads; all this adds to the core is that thread and the lock they share. A worker that died or hung is
dropped and every running request re-admitted with the tokens it had (``cluster.engine.engine_step.recover``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from cluster.background import in_background
from cluster.config import RaysampleConfig
from cluster.engine.audit import ConsistencyError
from cluster.engine.engine_core import EngineCore, NewRequest
from cluster.engine.engine_step import EngineFault
from cluster.engine.setup import coordinator_from_config, coordinator_inputs
from cluster.ray.ray_executor import RayExecutor
from cluster.ray.ray_metrics import EngineRayMetrics
from cluster.ray.startup_heap import freeze_startup_heap
from coordinator.request import RequestOutput


class StepLoop:
    # Build and publish step N's outputs while step N+1 runs: None decides from the cores
    # (``RayExecutor.has_spare_core``); bench/step_overhead.py sets it to measure what the overlap saves.
    overlap_outputs: bool | None = None

    def __init__(self, config: RaysampleConfig, placement: Any = None, workers: list[Any] | None = None,
                 kv_note: str | None = None, tokenizer: Any = None) -> None:
        """``placement`` / ``workers``: already launched by the driver (``Engine.start`` does, so the workers load
        while this process starts); else launched here. ``kv_note``: where the workers' KV budget came from
        (``cluster.memory``). ``tokenizer``: loaded by the driver (``shippable_tokenizer``), else here."""
        inputs = in_background(coordinator_inputs, config, tokenizer, name="raysample-coordinator-inputs")
        executor = RayExecutor(config, placement, workers)  # the tokenizer loads while the workers load
        num_blocks, block_size = executor.start()
        coordinator = coordinator_from_config(config, num_blocks, block_size, inputs.result(), kv_note)
        metrics = EngineRayMetrics(config.cluster.coordinator_name, config.model.display_name())
        self.core = EngineCore(config, executor, coordinator, metrics, round_trip_s=executor.round_trip_s())
        if self.overlap_outputs is None:
            self.overlap_outputs = executor.has_spare_core()
        self.lock = threading.Condition()
        self.tokenize_lock = threading.Lock()
        self._stop = False
        freeze_startup_heap()  # this actor's process is the engine's own
        self._thread = threading.Thread(target=self._loop, name="raysample-step-loop", daemon=True)
        self._thread.start()

    def add_requests(self, items: Sequence[tuple[Any, Any, str | None]], final_only: bool = False) -> list[str]:
        """Params are parsed and prompts tokenized before the lock is taken, so a huge prompt stalls no one,
        and a bad item fails alone (its own error output)."""
        requests = [NewRequest.parsed(*item, tokenize=self._tokenize) for item in items]
        with self.lock:
            ids = self.core.add_requests(requests, final_only)
            self.lock.notify_all()
            return ids

    def _tokenize(self, prompt: str) -> list[int]:
        with self.tokenize_lock:  # a fast tokenizer must not be entered by two threads at once
            return self.core.coordinator.tokenize(prompt)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            return self.core.abort(request_id)

    def worker_handles(self) -> list[Any]:
        return list(self.core.executor.workers.values())

    def poll(self, request_ids: Sequence[str], timeout_s: float, finished_only: bool = False) -> list[RequestOutput]:
        """Outputs of these requests since the last poll; waits up to ``timeout_s`` for one. ``finished_only``:
        wake only for final ones, so a blocking caller costs one round trip per finished request."""
        wanted, deadline = list(request_ids), time.monotonic() + timeout_s
        with self.lock:
            while True:
                ready = self.core.take_ready(wanted, finished_only)
                if ready:
                    return ready
                if self.core.fatal is not None and self.core.all_finished(wanted):
                    raise RuntimeError(self.core.fatal)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self.lock.wait(remaining)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {**self.core.stats(), "overlap_outputs": self.overlap_outputs}

    def shutdown(self) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        self._thread.join(timeout=self.core.config.cluster.call_timeout_s)
        self.core.executor.shutdown()

    def _loop(self) -> None:
        """Step while there is work; step N's outputs are built while step N+1 computes when ``overlap_outputs``."""
        while not self._stop:
            if self.core.fatal is None:
                try:
                    if self.core.step(self.lock, self.overlap_outputs, publish=self._publish) is not None:
                        continue
                except (ConsistencyError, EngineFault):
                    pass  # every pending request failed with it; the loop idles until shut down
            with self.lock:
                self.lock.notify_all()  # what the step or the failure published
                self.lock.wait(0.05)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.core.publish(outputs)
        if outputs:
            self.lock.notify_all()

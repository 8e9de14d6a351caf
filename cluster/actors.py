"""Thin Ray actors: each only hosts a plain object and forwards to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ray

from workers.wire import StepPlan, StepResult, WorkerInfo


@ray.remote
class WorkerActor:
    """Hosts a ``workers.worker.Worker`` on the device Ray assigned to this actor."""

    def __init__(self, worker_id: int, config: dict[str, Any], model_path: str) -> None:
        import torch

        from cluster.quiet import quiet_libraries

        quiet_libraries()
        from cluster.config import load_config
        from workers.worker import Worker

        gpu_ids = ray.get_gpu_ids()
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPUs: they are numbered from 0 here.
        device = torch.device("cuda", 0) if gpu_ids and torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cpu":
            from workers.threads import set_cpu_threads

            set_cpu_threads(config["cluster"]["cpus_per_worker"])  # this worker's share, not the host's cores
        self.worker = Worker.from_config(worker_id, load_config(config), model_path, device)
        self.device = str(device)

    def ready(self) -> str:
        return self.device

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.device, self.worker.runner.num_blocks, self.worker.runner.block_size)

    def step(self, plan: StepPlan) -> StepResult:
        return self.worker.step(plan)

    def reset(self) -> None:
        self.worker.reset()

    def pid(self) -> int:
        import os

        return os.getpid()


@ray.remote(max_concurrency=64)
class CoordinatorActor:
    """Hosts the ``cluster.engine_core.EngineCore`` step loop; many callers at once."""

    def __init__(self, config: dict[str, Any], placement: Any = None, workers: list[Any] | None = None,
                 kv_note: str | None = None) -> None:
        from cluster.engine_core import EngineCore
        from cluster.quiet import quiet_libraries

        quiet_libraries()
        self.core = EngineCore(config, placement, workers, kv_note)

    def ready(self) -> bool:
        return self.core.ready()

    def add_requests(self, items: list[tuple[Any, Any, str | None]], final_only: bool = False) -> list[str]:
        return self.core.add_requests(items, final_only)

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def poll(self, request_ids: list[str], timeout_s: float, finished_only: bool = False) -> list[Any]:
        return self.core.poll(request_ids, timeout_s, finished_only)

    def stream(self, request_id: str, wait_s: float = 30.0) -> Iterator[Any]:
        """A Ray streaming generator: each output as soon as the step loop publishes it."""
        while True:
            for out in self.core.poll([request_id], wait_s):
                yield out
                if out.finished:
                    return

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def worker_handles(self) -> list[Any]:
        return self.core.worker_handles()

    def shutdown(self) -> None:
        self.core.shutdown()

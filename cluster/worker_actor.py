"""The worker actor: hosts a ``workers.worker.Worker`` and forwards to it."""

from __future__ import annotations

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

"""A follower rank of a worker's tensor-parallel group: runs the forwards its lead sends, on its shard."""

from __future__ import annotations

from typing import Any

import ray

from cluster.ray.startup_heap import collection_paused, freeze_startup_heap
from workers.row_work import RowWork
from workers.wire import TensorRank


def device_of_actor() -> Any:
    """This actor's device: its GPU where Ray assigned one (numbered from 0 here), else the CPU."""
    import torch

    gpu_ids = ray.get_gpu_ids()
    # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPUs: they are numbered from 0 here.
    return torch.device("cuda", 0) if gpu_ids and torch.cuda.is_available() else torch.device("cpu")


def prepare_process(config: Any) -> Any:
    """Quiet libraries, size the CPU threads to this actor's share; returns its device."""
    from cluster.quiet import quiet_libraries, quiet_teardown

    quiet_teardown()
    quiet_libraries()
    device = device_of_actor()
    if device.type == "cpu":
        from workers.step.threads import set_cpu_threads

        set_cpu_threads(config.cluster.cpus_per_worker)  # this rank's share, not the host's cores
    return device


@ray.remote
class RankActor:
    def __init__(self, rank: TensorRank, config: Any) -> None:
        """``config``: the run's resolved configuration (``cluster.config.resolve``), as the driver built it."""
        from cluster.memory import check_device_memory
        from workers.model.tensor_parallel import join_group
        from cluster.engine.setup import worker_setup
        from workers.step.worker import build_runner

        with collection_paused():  # until the heap is frozen at the end
            device = prepare_process(config)
            check_device_memory(config, device)  # before any weight loads
            if config.model.simulate is None:  # simulated ranks only sleep: no collectives to meet
                join_group(rank, device, config.cluster.startup_timeout_s)  # meets the lead and the other ranks
            self.runner = build_runner(worker_setup(config), device)
            freeze_startup_heap()  # this actor's process is the engine's own

    def ready(self) -> bool:
        return True

    def forward(self, rows: list[RowWork]) -> None:
        from workers.model.lora import AdapterUnavailable

        try:
            self.runner.forward(rows)  # every rank gets the whole logits; the lead samples them
        except AdapterUnavailable:  # every rank agreed it: the lead fails the rows that use the adapter
            return
        wait_ready = getattr(self.runner, "wait_ready", None)
        if wait_ready is not None:  # a simulated rank: its step ends when modelled
            wait_ready()

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        self.runner.copy_blocks(sources, targets)

    def pid(self) -> int:
        import os

        return os.getpid()

    def memory(self) -> tuple[int, int]:
        """Bytes of this rank's model shard and KV cache."""
        return getattr(self.runner, "weight_bytes", 0), getattr(self.runner, "kv_bytes", 0)  # 0: simulated


def bundle_options(config: Any, placement: Any, bundle: int) -> dict[str, Any]:
    """Ray options of an actor holding one bundle's resources: a worker, or one rank of its group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cluster = config.cluster
    return {"num_cpus": cluster.cpus_per_worker, "num_gpus": cluster.gpus_per_worker,
            "memory": cluster.memory_per_worker,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle)}


def launch_followers(config: Any, placement: Any, index: int, address: str) -> list[Any]:
    """The other ranks of worker ``index``'s tensor-parallel group, on the bundles after its lead's.

    Started by the lead, they are owned by it: Ray ends them when the lead ends, so a group never
    outlives its worker."""
    size = config.model.tensor_parallel_size
    return [RankActor.options(**bundle_options(config, placement, index * size + rank)).remote(
                TensorRank(rank, size, address), config)
            for rank in range(1, size)]

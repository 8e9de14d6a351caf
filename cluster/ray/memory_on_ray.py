"""A CPU worker's memory budget on a Ray cluster: the smallest any node that could host it offers.

The plan itself (``cluster.memory``) knows nothing of Ray; this asks Ray what each node has free.
"""

from __future__ import annotations

from typing import Any

from cluster.memory import MemoryPlan, MemoryPlanError, ModelMemory, plan_cpu_memory, sized_by_memory, with_memory_plan


def plan_on_ray(config: Any) -> tuple[Any, str | None]:
    """The config the engines of ``config`` run on the Ray cluster joined, and where their budget came from.

    Every node that can host a worker is planned for as if it received as many of the engines'
    workers as its free CPUs (and GPUs) allow; each worker gets the smallest of those budgets, so
    it fits wherever Ray places it. Memory is what Ray has free for actors on the node now, so
    engines already running there (another job's, or a group's others) are accounted for."""
    if not sized_by_memory(config):
        return config, None
    from ray._private.state import available_resources_per_node

    cluster = config.cluster
    size = config.model.tensor_parallel_size
    total = cluster.num_engines * cluster.num_workers * size  # processes: one per rank
    model = ModelMemory.of(config.facts, config.model.dtype).per_rank(size)
    best: MemoryPlan | None = None
    refused: MemoryPlanError | None = None
    for resources in available_resources_per_node().values():
        fits = int(resources.get("CPU", 0.0) // cluster.cpus_per_worker)
        if fits < 1:
            continue
        try:
            plan = plan_cpu_memory(config, model, int(resources.get("memory", 0.0)), min(total, fits),
                                   "to Ray actors on the node")
        except MemoryPlanError as exc:
            refused = refused or exc
            continue
        if best is None or plan.kv_cache_memory < best.kv_cache_memory:
            best = plan
    if best is None:
        if refused is not None:
            raise refused
        return config, None  # no node has a free CPU: check_cluster_resources says so in one line
    return with_memory_plan(config, best), best.note

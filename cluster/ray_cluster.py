"""Starting or joining Ray, and placing the workers."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from cluster.config import RaysampleConfig

logger = logging.getLogger(__name__)


def ensure_ray(config: RaysampleConfig) -> None:
    """Join the cluster the config names (``auto``, ``ray://host:port``, ``host:port``) or start one (``local``).

    ``local`` joins the cluster of a Ray job instead when ``RAY_ADDRESS`` is set; otherwise it always
    starts a private instance, even when another cluster runs on this host (``address="local"``).
    """
    if ray.is_initialized():
        return
    cluster = config.cluster
    kwargs: dict[str, Any] = {"namespace": cluster.namespace, "log_to_driver": True, "ignore_reinit_error": True}
    if cluster.address == "local" and os.environ.get("RAY_ADDRESS"):
        # Inside `ray job submit` (or any driver told where its cluster is): join that cluster.
        ray.init(**kwargs)
    elif cluster.address == "local":
        # Logical CPUs: one per worker plus the coordinator, even on a small machine.
        needed = int(cluster.num_engines * cluster.num_workers * cluster.cpus_per_worker) + cluster.num_engines
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False, **kwargs)
    else:
        ray.init(address=cluster.address, **kwargs)


def worker_bundles(config: RaysampleConfig) -> list[dict[str, float]]:
    bundle: dict[str, float] = {"CPU": config.cluster.cpus_per_worker}
    if config.cluster.gpus_per_worker > 0:
        bundle["GPU"] = config.cluster.gpus_per_worker
    return [dict(bundle) for _ in range(config.cluster.num_workers)]


def check_cluster_resources(config: RaysampleConfig) -> None:
    """Fail in seconds, not after the placement timeout, when the cluster cannot ever hold the workers."""
    have = ray.cluster_resources()
    cluster = config.cluster
    engines = f"{cluster.num_engines} engines x " if cluster.num_engines > 1 else ""
    for resource, each in worker_bundles(config)[0].items():
        wanted = each * cluster.num_workers * cluster.num_engines
        if have.get(resource, 0.0) < wanted:
            raise RuntimeError(
                f"{engines}{cluster.num_workers} workers x {each:g} {resource} need {wanted:g} {resource}; the Ray "
                f"cluster has {have.get(resource, 0.0):g} in all ({'cluster.num_engines, ' if engines else ''}"
                f"cluster.num_workers, cluster.{'gpus' if resource == 'GPU' else 'cpus'}_per_worker)")


def launch_worker(config: RaysampleConfig, placement: PlacementGroup, index: int) -> Any:
    """Start worker ``index`` on its bundle; it loads the model in its constructor (not awaited here)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.actors import WorkerActor

    cluster = config.cluster
    return WorkerActor.options(
        num_cpus=cluster.cpus_per_worker,
        num_gpus=cluster.gpus_per_worker,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index),
    ).remote(index, config.model_dump(by_alias=True), config.model.resolve_path())


def create_worker_placement(config: RaysampleConfig, timeout_s: float, wait: bool = True) -> PlacementGroup:
    """One bundle per worker, with the config's strategy; fails clearly if it cannot be placed.

    ``wait=False``: return at once (actors on it start when it is placed); call ``wait_for_placement``.
    """
    group = placement_group(worker_bundles(config), strategy=config.cluster.placement_strategy)
    if wait:
        wait_for_placement(group, config, timeout_s)
    return group


def wait_for_placement(group: PlacementGroup, config: RaysampleConfig, timeout_s: float) -> None:
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"could not place {config.cluster.num_workers} workers with {worker_bundles(config)[0]} each "
            f"({config.cluster.placement_strategy}) within {timeout_s:.0f}s; cluster resources: "
            f"{ray.cluster_resources()}"
        ) from None

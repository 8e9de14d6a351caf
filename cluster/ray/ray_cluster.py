"""Starting or joining Ray, and placing the workers."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
    with callers_sigterm_handler(), quiet_ray_start():
        _init(config)


@contextmanager
def quiet_ray_start() -> Iterator[None]:
    """Ray's start-up lines (the token-authentication notice, "Started a local Ray instance") are not
    the job's: they are shown only with ``--verbose`` (``RAYSAMPLE_VERBOSE``). Ray's logger is put back
    afterwards, so warnings while the job runs still show."""
    ray_logger = logging.getLogger("ray")
    previous = ray_logger.level
    if not os.environ.get("RAYSAMPLE_VERBOSE"):
        ray_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ray_logger.setLevel(previous)


@contextmanager
def callers_sigterm_handler() -> Iterator[None]:
    """``ray.init`` installs a SIGTERM handler of its own (``sys.exit(15)``, and a native one that dumps a
    stack and aborts): the caller's (the job's: one line and exit 143) is put back once Ray is up."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _init(config: RaysampleConfig) -> None:
    cluster = config.cluster
    kwargs: dict[str, Any] = {"namespace": cluster.namespace, "log_to_driver": True, "ignore_reinit_error": True,
                              "logging_level": logging.getLogger("ray").getEffectiveLevel()}
    if cluster.address == "local" and os.environ.get("RAY_ADDRESS"):
        # Inside `ray job submit` (or any driver told where its cluster is): join that cluster.
        ray.init(**kwargs)
    elif cluster.address == "local":
        # A private instance serves this job alone: every Ray server (GCS, raylets, workers, the metrics
        # agent) listens on the loopback interface only. Ray maps a node IP of 127.0.0.1 back to the
        # host's address unless it is told it runs no cluster; children inherit the variable.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
        # Logical CPUs: one per worker plus the coordinator, even on a small machine.
        needed = int(cluster.num_engines * cluster.num_workers * config.model.tensor_parallel_size
                     * cluster.cpus_per_worker) + cluster.num_engines
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False, **kwargs)
    else:
        ray.init(address=cluster.address, **kwargs)


def worker_bundles(config: RaysampleConfig) -> list[dict[str, float]]:
    bundle: dict[str, float] = {"CPU": config.cluster.cpus_per_worker}
    if config.cluster.gpus_per_worker > 0:
        bundle["GPU"] = config.cluster.gpus_per_worker
    if config.cluster.memory_per_worker is not None:
        bundle["memory"] = float(config.cluster.memory_per_worker)
    # One bundle per rank, a worker's ranks next to each other: worker i's rank r is bundle i * size + r.
    return [dict(bundle) for _ in range(config.cluster.num_workers * config.model.tensor_parallel_size)]


_SETTING = {"GPU": "cluster.gpus_per_worker", "CPU": "cluster.cpus_per_worker",
            "memory": "cluster.memory_per_worker (the weights + cache.kv_cache_memory of a CPU worker)"}


def _amount(resource: str, value: float) -> str:
    return f"{value / 2**30:.2f} GiB of memory" if resource == "memory" else f"{value:g} {resource}"


def check_cluster_resources(config: RaysampleConfig) -> None:
    """Fail in seconds, not after the placement timeout, when the cluster cannot ever hold the workers:
    in all, and (memory) on any one node."""
    have = ray.cluster_resources()
    cluster = config.cluster
    engines = f"{cluster.num_engines} engines x " if cluster.num_engines > 1 else ""
    size = config.model.tensor_parallel_size
    ranks = f" x {size} ranks" if size > 1 else ""
    for resource, each in worker_bundles(config)[0].items():
        wanted = each * cluster.num_workers * cluster.num_engines * size
        if have.get(resource, 0.0) < wanted:
            raise RuntimeError(
                f"{engines}{cluster.num_workers} workers{ranks} x {_amount(resource, each)} need "
                f"{_amount(resource, wanted)}; "
                f"the Ray cluster has {_amount(resource, have.get(resource, 0.0))} in all "
                f"({'cluster.num_engines, ' if engines else ''}cluster.num_workers, {_SETTING[resource]})")
    if cluster.memory_per_worker is not None:
        largest = max((node["Resources"].get("memory", 0.0) for node in ray.nodes() if node.get("Alive")), default=0.0)
        if largest < cluster.memory_per_worker:
            raise RuntimeError(
                f"a worker needs {_amount('memory', cluster.memory_per_worker)} and the largest Ray node has "
                f"{_amount('memory', largest)} for actors ({_SETTING['memory']})")


def launch_worker(config: RaysampleConfig, placement: PlacementGroup, index: int) -> Any:
    """Start worker ``index`` on its bundle (its lead rank's, with tensor parallelism); it loads the
    model in its constructor (not awaited here)."""
    from cluster.ray.rank_actor import bundle_options
    from cluster.ray.worker_actor import WorkerActor

    bundle = index * config.model.tensor_parallel_size
    return WorkerActor.options(**bundle_options(config, placement, bundle)).remote(
        index, config, placement)


def create_worker_placement(config: RaysampleConfig, timeout_s: float, wait: bool = True) -> PlacementGroup:
    """One bundle per worker, with the config's strategy; fails clearly if it cannot be placed.

    ``wait=False``: return at once (actors on it start when it is placed); call ``wait_for_placement``.
    """
    name = placement_name(config.cluster.coordinator_name) if config.cluster.coordinator_name else ""
    group = placement_group(worker_bundles(config), strategy=config.cluster.placement_strategy, name=name)
    if wait:
        wait_for_placement(group, config, timeout_s)
    return group


PLACEMENT_SUFFIX = "/workers"


def placement_name(engine_name: str) -> str:
    """The name of an engine's workers' placement group: a placement group outlives the actor that made
    it (it belongs to the job), so whoever finds it orphaned can tell whose it was."""
    return engine_name + PLACEMENT_SUFFIX


# Engine-name prefixes of the Ray Data datasets this process built (``cluster.entrypoints.data``): their
# engines run in Ray Data's actors, which Ray Data may let go without shutting the engine down.
DATASET_ENGINE_PREFIXES: list[str] = []


def release_orphaned_placements(namespace: str, engine_prefixes: list[str] = DATASET_ENGINE_PREFIXES) -> int:
    """Remove the placement groups of engines named with one of ``engine_prefixes`` whose coordinator is
    gone; returns how many. A placement group belongs to the job, not to the actor that made it, so an
    engine let go without a shutdown left its workers' CPUs held until the driver ended, and the next
    dataset or engine on a small cluster waited for them forever. Called before an engine or a dataset
    starts, in the process that built the earlier datasets."""
    if not engine_prefixes:
        return 0
    released = 0
    for entry in ray.util.placement_group_table().values():
        name = entry.get("name") or ""
        if entry.get("state") != "CREATED" or not name.endswith(PLACEMENT_SUFFIX):
            continue
        engine = name.removesuffix(PLACEMENT_SUFFIX)
        if not any(engine.startswith(prefix) for prefix in engine_prefixes):
            continue
        try:
            ray.get_actor(engine, namespace=namespace)
        except ValueError:
            remove_placement_group(ray.util.get_placement_group(name))
            released += 1
    return released


def wait_for_placement(group: PlacementGroup, config: RaysampleConfig, timeout_s: float) -> None:
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        ranks = (f" x {config.model.tensor_parallel_size} ranks" if config.model.tensor_parallel_size > 1 else "")
        raise RuntimeError(
            f"could not place {config.cluster.num_workers} workers{ranks} with {worker_bundles(config)[0]} each "
            f"({config.cluster.placement_strategy}) within {timeout_s:.0f}s; cluster resources: "
            f"{ray.cluster_resources()}"
        ) from None

"""The worker actor: hosts a ``workers.step.worker.Worker`` and forwards to it.

With ``model.tensor_parallel_size`` > 1 it is the lead rank of the worker's group: it starts the
other ranks (``cluster.ray.rank_actor``), joins their process group and sends them every forward."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import ray

from cluster.ray.rank_actor import launch_followers, prepare_process
from cluster.ray.startup_heap import collection_paused, freeze_startup_heap
from workers.model.tensor_parallel import TensorGroupLost
from workers.row_work import RowWork
from workers.wire import StepPlan, StepResult, TensorRank, WorkerInfo

logger = logging.getLogger(__name__)


class RayFollowers:
    """The lead's link to its follower ranks: calls queue in order on each actor; ``wait`` collects them."""

    def __init__(self, actors: list[Any], timeout_s: float) -> None:
        self.actors = actors
        self.timeout_s = timeout_s
        self._pending: list[Any] = []

    def send_forward(self, rows: list[RowWork]) -> None:
        shared = ray.put(rows)
        self._pending += [actor.forward.remote(shared) for actor in self.actors]

    def send_copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        self._pending += [actor.copy_blocks.remote(sources, targets) for actor in self.actors]

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        try:
            ray.get(pending, timeout=self.timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise TensorGroupLost(f"a rank of this worker's tensor-parallel group failed ({type(exc).__name__}: "
                                  f"{first})") from None


def _rendezvous() -> str:
    """A free port on this node for the group's process group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


def _end_if_a_rank_fails(followers: list[Any], loaded: threading.Event) -> None:
    """While the group starts, the lead waits in collectives its ranks must join: a rank that fails
    to start would leave it waiting for the whole start-up timeout. End the lead at once instead,
    with the rank's error, so the engine reports the failure now."""
    pending = [f.ready.remote() for f in followers]
    while pending and not loaded.is_set():
        done, pending = ray.wait(pending, timeout=1.0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:
                logger.error("a tensor-parallel rank failed to start; ending its group: %s",
                             str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
                os._exit(1)


@ray.remote
class WorkerActor:
    """Hosts a ``workers.step.worker.Worker`` on the device Ray assigned to this actor."""

    def __init__(self, worker_id: int, config: Any, placement: Any = None) -> None:
        """``config``: the run's resolved configuration (``cluster.config.resolve``), as the driver built it."""
        with collection_paused():  # until the heap is frozen below
            self._start(worker_id, config, placement)

    def _start(self, worker_id: int, config: Any, placement: Any) -> None:
        from cluster.memory import check_device_memory
        from cluster.engine.setup import worker_setup
        from workers.step.worker import Worker

        device = prepare_process(config)
        check_device_memory(config, device)  # before any weight loads
        followers = None
        self.followers: list[Any] = []
        size = config.model.tensor_parallel_size
        if size > 1:
            from workers.model.tensor_parallel import join_group

            address = _rendezvous()
            self.followers = launch_followers(config, placement, worker_id, address)
            loading = threading.Event()
            threading.Thread(target=_end_if_a_rank_fails, args=(self.followers, loading), daemon=True,
                             name="raysample-rank-watch").start()
            if config.model.simulate is None:
                join_group(TensorRank(0, size, address), device, config.cluster.startup_timeout_s)
            followers = RayFollowers(self.followers, config.cluster.call_timeout_s)
        self.worker = Worker.from_setup(worker_id, worker_setup(config), device, followers=followers)
        if size > 1:
            loading.set()
        self.device = str(device)
        freeze_startup_heap()  # this actor's process is the engine's own

    def ready(self) -> str:
        return self.device

    def info(self) -> WorkerInfo:
        runner = self.worker.runner
        memory = [(getattr(runner, "weight_bytes", 0), getattr(runner, "kv_bytes", 0))]  # 0: simulated
        memory += ray.get([f.memory.remote() for f in self.followers])
        return WorkerInfo(self.device, runner.num_blocks, runner.block_size,
                          weight_bytes=tuple(w for w, _ in memory), kv_bytes=tuple(k for _, k in memory))

    def step(self, plan: StepPlan) -> StepResult:
        try:
            return self.worker.step(plan)
        except TensorGroupLost as exc:
            # The group cannot go on without the rank: end it as one worker (its followers end with
            # this actor, their owner), so the engine requeues its rows and starts a new group.
            logger.error("worker %d: %s; ending the group", self.worker.worker_id, exc)
            os._exit(1)

    def reset(self) -> None:
        self.worker.reset()

    def self_check(self) -> str | None:
        return self.worker.self_check()

    def pid(self) -> int:
        return os.getpid()

    def rank_pids(self) -> list[int]:
        """This process and its follower ranks' processes, rank by rank."""
        return [os.getpid(), *ray.get([f.pid.remote() for f in self.followers])]

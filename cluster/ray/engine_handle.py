"""A handle on one engine on Ray (its named coordinator actor): start it, attach to it, call it.

Users meet it as ``cluster.entrypoints.client.Engine``; an ``EngineGroup`` holds one per engine."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.config import RaysampleConfig
from cluster.engine.engine_api import POLL_S, RequestAPI
from cluster.engine.prompts import Params, PromptInput, as_prompt, params_per_prompt
from cluster.ray.ray_cluster import (create_worker_placement, launch_worker, release_orphaned_placements,
                                     wait_for_placement)
from coordinator.request import RequestOutput

_NAME_TAKEN = getattr(ray.exceptions, "ActorAlreadyExistsError", ValueError)


class EngineError(RuntimeError):
    """The engine refused or failed a call; the message is the engine's own."""


class EngineGone(EngineError):
    """The engine's coordinator process is dead: nothing more will come from it."""


def _call(ref: Any, timeout_s: float | None) -> Any:
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        raise EngineError(str(getattr(exc, "cause", None) or exc)) from None
    except ray.exceptions.RayActorError as exc:
        raise EngineGone(f"the raysample coordinator is gone: {exc}") from None
    except ray.exceptions.GetTimeoutError:
        raise EngineError(f"the raysample coordinator did not answer within {timeout_s}s") from None


def _engine_exists(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def _name_taken(name: str, namespace: str) -> EngineError:
    return EngineError(f"an engine named {name!r} already runs in namespace {namespace!r}; give this one another "
                       f"name (--job-name / cluster.coordinator_name) or attach to that one with "
                       f"Engine.connect({name!r})")


def _release(placement: Any, workers: list[Any]) -> None:
    """Workers and placement of an engine that did not start (its coordinator owns them once it has)."""
    for worker in workers:
        ray.kill(worker)
    ray.util.remove_placement_group(placement)


def with_engine_name(config: RaysampleConfig, prefix: str | None = None) -> RaysampleConfig:
    """The config with its engine name set: the one it names, else a fresh unique one; with ``prefix`` (one of a
    dataset's engines, ``cluster.entrypoints.data``) always a fresh one under that prefix."""
    if config.cluster.coordinator_name and prefix is None:
        return config
    name = f"{prefix or 'raysample'}-{uuid.uuid4().hex[:8]}"
    return config.model_copy(update={"cluster": config.cluster.model_copy(update={"coordinator_name": name})})


class EngineHandle(RequestAPI):
    """Handle on one running raysample engine (a named coordinator actor); any number of callers."""

    def __init__(self, actor: Any, timeout_s: float = 120.0, owner: bool = False, name: str | None = None,
                 placement: Any = None, workers: Sequence[Any] = ()) -> None:
        self._actor = actor
        self.name = name
        self.timeout_s = timeout_s
        self._owner = owner
        self._placement, self._workers = placement, list(workers)  # released by the owner if the coordinator dies

    @classmethod
    def start(cls, config: RaysampleConfig, kv_note: str | None = None) -> EngineHandle:
        """One engine, on a Ray already joined, under the config's (set) name. ``kv_note``: where its
        workers' KV budget came from (``cluster.memory``), for the start-up line."""
        from cluster.ray.coordinator_actor import CoordinatorActor
        from cluster.engine.setup import shippable_tokenizer

        name, namespace = config.cluster.coordinator_name, config.cluster.namespace
        if _engine_exists(name, namespace):
            raise _name_taken(name, namespace)
        release_orphaned_placements(namespace)
        # The workers start loading the model now, while the coordinator's process starts.
        placement = create_worker_placement(config, config.cluster.call_timeout_s, wait=False)
        workers = [launch_worker(config, placement, i) for i in range(config.cluster.num_workers)]
        try:
            wait_for_placement(placement, config, config.cluster.call_timeout_s)
        except RuntimeError as exc:
            _release(placement, workers)
            raise EngineError(str(exc)) from None
        # The coordinator lives on this driver's node: losing another node never takes it down.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        tokenizer = shippable_tokenizer(config.facts)
        try:
            actor = CoordinatorActor.options(
                name=name, namespace=namespace, num_cpus=0, scheduling_strategy=here,
            ).remote(config, placement, workers, kv_note, tokenizer)
        except _NAME_TAKEN:  # started by another driver since the check above
            _release(placement, workers)
            raise _name_taken(name, namespace) from None
        # Model loading on every worker happens inside the constructor.
        try:
            _call(actor.ready.remote(), config.cluster.startup_timeout_s + config.cluster.call_timeout_s)
        except BaseException:
            ray.kill(actor)
            _release(placement, workers)
            raise
        return cls(actor, config.cluster.call_timeout_s, owner=True, name=name, placement=placement, workers=workers)

    @classmethod
    def connect(cls, name: str, namespace: str = "raysample",
                address: str = "auto", timeout_s: float = 120.0) -> EngineHandle:
        """Attach to an engine another driver started."""
        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, ignore_reinit_error=True)
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise EngineError(f"no raysample engine named {name!r} in namespace {namespace!r}") from None
        return cls(actor, timeout_s, name=name)

    # ----- requests (submit, results and generate come from RequestAPI) -----

    def submit_many(self, prompts: Sequence[PromptInput], sampling_params: Params = None,
                    request_ids: Sequence[str | None] | None = None, final_only: bool = False) -> list[str]:
        """``final_only``: the engine builds and publishes only these requests' final outputs."""
        prompts = [as_prompt(p) for p in prompts]
        items = list(zip(prompts, params_per_prompt(sampling_params, len(prompts)),
                         request_ids or [None] * len(prompts)))
        return _call(self._actor.add_requests.remote(items, final_only), self.timeout_s)

    def abort(self, request_id: str) -> bool:
        return _call(self._actor.abort.remote(request_id), self.timeout_s)

    def poll(self, request_ids: Sequence[str], timeout_s: float = POLL_S, finished_only: bool = False
             ) -> list[RequestOutput]:
        return _call(self.poll_ref(request_ids, timeout_s, finished_only), timeout_s + self.timeout_s)

    def poll_ref(self, request_ids: Sequence[str], timeout_s: float, finished_only: bool = False) -> Any:
        """``poll`` without waiting: the Ray ref of its answer (an ``EngineGroup`` waits on several)."""
        return self._actor.poll.remote(list(request_ids), timeout_s, finished_only)

    async def stream(self, prompt: PromptInput, sampling_params: Params = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """A Ray streaming generator on the coordinator pushes outputs as they are published;
        leaving the loop early aborts the request, as vLLM does when a stream is dropped."""
        loop = asyncio.get_running_loop()
        request_id = await loop.run_in_executor(None, self.submit, prompt, sampling_params, request_id)
        finished = False
        try:
            async for ref in self._actor.stream.options(num_returns="streaming").remote(request_id):
                try:
                    out = await ref
                except ray.exceptions.RayTaskError as exc:
                    raise EngineError(str(getattr(exc, "cause", None) or exc)) from None
                except ray.exceptions.RayActorError as exc:
                    raise EngineError(f"the raysample coordinator is gone: {exc}") from None
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                await loop.run_in_executor(None, self.abort, request_id)

    def stats(self) -> dict[str, Any]:
        return _call(self._actor.stats.remote(), self.timeout_s)

    def worker_handles(self) -> list[Any]:
        return _call(self._actor.worker_handles.remote(), self.timeout_s)

    def shutdown(self) -> None:
        """Stop the loop, the workers and the coordinator (only the driver that started it should)."""
        try:
            _call(self._actor.shutdown.remote(), self.timeout_s)
        finally:
            ray.kill(self._actor)
            time.sleep(0.1)

    def release(self) -> None:
        """What a dead coordinator leaves behind: its workers and their placement group."""
        ray.kill(self._actor)
        if self._owner and self._placement is not None:
            _release(self._placement, self._workers)
            self._placement, self._workers = None, []

"""The whole engine in one process, stepped by its callers: the same ``EngineCore`` as the Ray deployment
(which steps it on a thread of its own, ``cluster.ray.step_loop``); used by most tests and by single-machine runs."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from cluster.config import RaysampleConfig
from cluster.engine.engine_api import POLL_S, RequestAPI
from cluster.engine.engine_core import EngineCore, NewRequest
from cluster.engine.inprocess_executor import InProcessExecutor, local_device
from cluster.engine.prompts import Params, Prompt, PromptInput, as_prompt, params_per_prompt
from cluster.preflight import prepare_run
from cluster.engine.setup import coordinator_from_config, worker_setup
from coordinator.request import RequestOutput
from processors import SamplingParams
from workers.step.threads import set_cpu_threads
from workers.step.worker import Worker


class LocalEngine(RequestAPI):
    """The engine in this process: same API and return types as ``Engine``, stepped by its callers."""

    def __init__(self, config: RaysampleConfig | dict[str, Any] | str | Path) -> None:
        """``config``: prepared by an entry point (``prepare_run``), or here where the run starts with it."""
        from cluster.memory import plan_in_process

        config = prepare_run(config, local=True)
        self.model_path = config.facts.path
        self.config, kv_note = plan_in_process(config)  # before any worker allocates
        if local_device(self.config, 0).type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            set_cpu_threads()  # the workers run one after another here: each may use every usable core
        cluster, setup = self.config.cluster, worker_setup(self.config)
        executor = InProcessExecutor(lambda i: Worker.from_setup(i, setup, local_device(self.config, i)),
                                     cluster.num_workers, cluster.call_timeout_s, cluster.max_worker_replacements)
        workers = list(executor.workers.values())
        coordinator = coordinator_from_config(self.config, min(w.runner.num_blocks for w in workers),
                                              workers[0].runner.block_size, kv_note=kv_note)
        self.core = EngineCore(self.config, executor, coordinator)

    coordinator = property(lambda self: self.core.coordinator)
    executor = property(lambda self: self.core.executor)
    tokenizer = property(lambda self: self.core.coordinator.tokenizer)
    workers = property(lambda self: list(self.core.executor.workers.values()))

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    final_only: bool = False) -> str:
        """``final_only``: no intermediate outputs for this request (``generate`` asks so)."""
        return self.core.add_requests([NewRequest(as_prompt(prompt), params, request_id)], final_only)[0]

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.coordinator.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that changed since the last step or poll."""
        self._advance()
        return self.core.drain()

    def _advance(self) -> bool:
        """One step; True when there was nothing to run (a constraint may be compiling: wait a little)."""
        if self.core.step() is not None:
            return False
        self.core.coordinator.wait_for_grammars(0.05)
        return True

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.executor.shutdown()

    # ----- the RequestAPI primitives (submit, results and generate come from there) -----

    def submit_many(self, prompts: Sequence[PromptInput], sampling_params: Params = None,
                    request_ids: Sequence[str | None] | None = None, final_only: bool = False) -> list[str]:
        params = params_per_prompt(sampling_params, len(prompts))
        return self.core.add_requests([NewRequest(as_prompt(p), sp, rid) for p, sp, rid in
                                       zip(prompts, params, request_ids or [None] * len(prompts))], final_only)

    def poll(self, request_ids: Sequence[str], timeout_s: float = POLL_S, finished_only: bool = False
             ) -> list[RequestOutput]:
        """As ``Engine.poll``, stepping the engine here (at least once) until one of these has an output."""
        wanted, deadline, stepped, idle = list(request_ids), time.monotonic() + timeout_s, False, False
        while True:
            ready = self.core.take_ready(wanted, finished_only)
            if ready:
                return ready
            if idle and self.core.all_finished(wanted):  # a step with nothing to run published everything
                raise KeyError(f"unknown request id(s), or their final outputs were already delivered: {wanted}")
            if stepped and time.monotonic() >= deadline:
                return []
            idle, stepped = self._advance(), True

    async def stream(self, prompt: PromptInput, sampling_params: Params = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Steps the engine between outputs (in this event loop's thread); leaving early aborts."""
        request_id = self.submit(prompt, sampling_params, request_id)
        finished = False
        try:
            while not finished:
                for out in self.poll([request_id], 0.0):
                    finished = out.finished
                    yield out
                await asyncio.sleep(0)
        finally:
            if not finished:
                self.abort(request_id)

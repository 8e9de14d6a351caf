"""The whole engine in one process: coordinator and workers as plain objects.

Same step loop as the Ray deployment (which only hosts these objects in
actors); used by most tests and by single-machine runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from cluster.config import RaysampleConfig, resolve
from cluster.engine import engine_step
from cluster.engine.engine_api import POLL_S, RequestAPI, take_ready
from cluster.engine.engine_step import EngineFault
from cluster.engine.inprocess_executor import InProcessExecutor
from cluster.engine.prompts import Params, Prompt, PromptInput, as_prompt, params_per_prompt
from coordinator.factory import coordinator_from_config
from coordinator.request import RequestOutput
from processors import SamplingParams
from workers.step.threads import set_cpu_threads
from workers.step.worker import Worker

logger = logging.getLogger(__name__)


def local_device(config: RaysampleConfig, worker_id: int) -> torch.device:
    """A GPU when the config asks for one; asking for one that this process cannot see is an error."""
    if config.cluster.gpus_per_worker > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"cluster.gpus_per_worker={config.cluster.gpus_per_worker} but no GPU is visible "
                               "to this process; set it to 0 to run on CPU")
        return torch.device("cuda", worker_id % torch.cuda.device_count())
    return torch.device("cpu")


class LocalEngine(RequestAPI):
    """The engine in this process: same API and return types as ``Engine``, stepped by its callers."""

    def __init__(self, config: RaysampleConfig | dict[str, Any] | str | Path) -> None:
        """``config``: resolved by an entry point (``cluster.config.resolve``), or resolved here once when
        this engine is where the run starts."""
        from cluster.memory import plan_in_process

        config = resolve(config)
        if config.cluster.num_engines > 1:
            from cluster.preflight import local_engines_message

            raise ValueError(local_engines_message(config))
        if config.model.tensor_parallel_size > 1:
            from cluster.preflight import check_tensor_parallel

            check_tensor_parallel(config, local=True)
        self.model_path = config.facts.path
        self.config, kv_note = plan_in_process(config)  # before any worker allocates
        if local_device(self.config, 0).type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            set_cpu_threads()  # the workers run one after another here: each may use every usable core
        cluster = self.config.cluster
        self.executor = InProcessExecutor(
            lambda i: Worker.from_config(i, self.config, local_device(self.config, i)),
            cluster.num_workers, cluster.call_timeout_s, cluster.max_worker_replacements)
        num_blocks = min(w.runner.num_blocks for w in self.workers)
        self.coordinator = coordinator_from_config(self.config, num_blocks, self.workers[0].runner.block_size)
        self.coordinator.kv_note = kv_note
        logger.info("%s", self.coordinator.kv_summary())
        self._outputs: dict[str, list[RequestOutput]] = {}  # made by steps, not yet polled
        self.fatal: str | None = None  # the engine failed (``EngineFault``): it takes no more requests

    @property
    def tokenizer(self) -> Any:
        return self.coordinator.tokenizer

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    final_only: bool = False) -> str:
        """``final_only``: no intermediate outputs for this request (``generate`` asks so)."""
        if self.fatal is not None:
            raise EngineFault(self.fatal)
        return self.coordinator.add_request(as_prompt(prompt), params, request_id, final_only=final_only)

    def abort(self, request_id: str) -> bool:
        return self.coordinator.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.coordinator.has_unfinished()

    @property
    def workers(self) -> list[Worker]:
        return list(self.executor.workers.values())

    @property
    def replacements(self) -> int:
        return self.executor.replacements

    def step(self) -> list[RequestOutput]:
        """One engine step (``cluster.engine.engine_step``); returns the outputs of requests that changed."""
        outputs: list[RequestOutput] = []
        try:
            done = engine_step.step(self.coordinator, self.executor, outputs.extend)
        except EngineFault as exc:  # every pending request fails as retryable; no new one is taken
            self.fatal = str(exc)
            outputs.extend(self.coordinator.fail_all(self.fatal))
            self._buffer(outputs)
            raise
        if done is None:
            self.coordinator.wait_for_grammars(0.05)
        return outputs + self.coordinator.take_outputs()

    def stats(self) -> dict[str, Any]:
        m, c = self.coordinator.metrics, self.coordinator
        return {"running": c.num_running(), "waiting": c.num_waiting(), "workers_alive": len(self.workers),
                "steps": m.steps, "generated_tokens": m.generated_tokens, "tokens_per_s": m.generation_rate.rate(),
                "spec_acceptance": m.spec_acceptance, "ahead_rows": m.ahead_rows,
                "ahead_wasted_rows": m.ahead_wasted_rows, **c.kv_stats(), "kv_cache": c.kv_summary()}

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ----- the RequestAPI primitives (submit, results and generate come from there) -----

    def submit_many(self, prompts: Sequence[PromptInput], sampling_params: Params = None,
                    request_ids: Sequence[str | None] | None = None, final_only: bool = False) -> list[str]:
        prompts = [as_prompt(p) for p in prompts]
        params = params_per_prompt(sampling_params, len(prompts))
        with self.coordinator.submitting_together():
            return [self.add_request(p, sp, rid, final_only=final_only)
                    for p, sp, rid in zip(prompts, params, request_ids or [None] * len(prompts))]

    def poll(self, request_ids: Sequence[str], timeout_s: float = POLL_S, finished_only: bool = False
             ) -> list[RequestOutput]:
        """As ``Engine.poll``, stepping the engine here until one of these requests has an output."""
        wanted = list(request_ids)
        deadline = time.monotonic() + timeout_s
        stepped = False  # step at least once, whatever the timeout
        while True:
            self._buffer(self.coordinator.take_outputs())  # finished without a step: errors, aborts
            ready = take_ready(self._outputs, wanted, finished_only)
            if ready:
                return ready
            known = self.coordinator.requests
            gone = [rid for rid in wanted if rid not in known or known[rid].finished]
            if len(gone) == len(wanted):
                raise KeyError(f"unknown request id(s), or their final outputs were already delivered: {gone}")
            if stepped and time.monotonic() >= deadline:
                return []
            self._buffer(self.step())
            stepped = True

    def _buffer(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._outputs.setdefault(out.request_id, []).append(out)

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

    def run(self, request_ids: Sequence[str]) -> Iterator[RequestOutput]:
        """Step until these requests finish, yielding their outputs as they change (synchronous stream)."""
        self._buffer(self.coordinator.take_outputs())
        known = self.coordinator.requests
        pending = {rid for rid in request_ids if rid in self._outputs or (rid in known and not known[rid].finished)}
        while pending:
            for out in self.poll(sorted(pending), 0.0):
                if out.finished:
                    pending.discard(out.request_id)
                yield out

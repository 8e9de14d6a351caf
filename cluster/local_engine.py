"""The whole engine in one process: coordinator and workers as plain objects.

Same step loop as the Ray deployment (which only hosts these objects in
actors); used by most tests and by single-machine runs.
"""

from __future__ import annotations

import os

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import logging

import torch

from cluster.audit import check_consistency
from cluster.config import RaysampleConfig, load_config
from cluster.prompts import Prompt, as_prompt, as_prompt_list, params_per_prompt
from coordinator.coordinator import coordinator_from_config
from coordinator.request import RequestOutput
from processors import SamplingParams
from workers.sampler import LogitsProcessorError
from workers.threads import set_cpu_threads
from workers.worker import Worker

logger = logging.getLogger(__name__)



def local_device(config: RaysampleConfig, worker_id: int) -> torch.device:
    """A GPU when the config asks for one; asking for one that this process cannot see is an error."""
    if config.cluster.gpus_per_worker > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"cluster.gpus_per_worker={config.cluster.gpus_per_worker} but no GPU is visible "
                               "to this process; set it to 0 to run on CPU")
        return torch.device("cuda", worker_id % torch.cuda.device_count())
    return torch.device("cpu")


class LocalEngine:
    def __init__(self, config: RaysampleConfig | dict[str, Any] | str | Path) -> None:
        self.config = load_config(config)
        model_path = self.config.model.resolve_path()
        if local_device(self.config, 0).type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            set_cpu_threads()  # the workers run one after another here: each may use every usable core
        self.workers = [
            Worker.from_config(i, self.config, model_path, local_device(self.config, i))
            for i in range(self.config.cluster.num_workers)
        ]
        num_blocks = min(w.runner.num_blocks for w in self.workers)
        self.coordinator = coordinator_from_config(self.config, model_path, num_blocks, self.workers[0].runner.block_size)
        logger.info("%s", self.coordinator.kv_summary())

    @property
    def tokenizer(self) -> Any:
        return self.coordinator.tokenizer

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    final_only: bool = False) -> str:
        """``final_only``: no intermediate outputs for this request (``generate`` asks so)."""
        return self.coordinator.add_request(as_prompt(prompt), params, request_id, final_only=final_only)

    def abort(self, request_id: str) -> bool:
        return self.coordinator.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.coordinator.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that changed."""
        plan = self.coordinator.next_plan()
        if plan is None:
            self.coordinator.wait_for_grammars(0.05)
            return self.coordinator.take_outputs()
        try:
            results = [worker.step(plan) for worker in self.workers]
        except LogitsProcessorError as exc:  # fail who enables the processor; the engine goes on
            self.coordinator.fail_step(exc.rows, f"step failed: {exc}", range(len(self.workers)))
            for worker in self.workers:
                worker.reset()
            return self.coordinator.take_outputs()
        if plan.audit:
            check_consistency(plan.step, results)
        return self.coordinator.process(plan, results)

    def submit(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None, final_only: bool = False) -> list[str]:
        """Queue prompts (one prompt may be text or a token-id list); return their request ids."""
        prompts = as_prompt_list(prompts)
        return [self.add_request(p, sp, final_only=final_only)
                for p, sp in zip(prompts, params_per_prompt(params, len(prompts)))]

    def run(self, request_ids: Sequence[str]) -> Iterator[RequestOutput]:
        """Step until these requests finish, yielding their outputs as they change."""
        wanted = set(request_ids)
        pending = {rid for rid in wanted if not self.coordinator.requests[rid].finished}
        for out in self.coordinator.take_outputs():
            if out.request_id in wanted:
                yield out
        while pending:
            for out in self.step():
                if out.request_id in wanted:
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput every time one of these requests gains text or finishes."""
        return self.run(self.submit(prompts, params))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        ids = self.submit(prompts, params, final_only=True)
        final = {out.request_id: out for out in self.run(ids) if out.finished}
        return [final[rid] for rid in ids]

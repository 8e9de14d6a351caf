"""What a worker is built from: one typed record, filled from the run's config by the cluster layer
(``cluster.engine.setup.worker_setup``), so nothing below ``cluster`` reads the config itself."""

from __future__ import annotations

from dataclasses import dataclass

from processors import EngineConfig
from processors.loading import CustomProcessor
from workers.doubles.simulated_runner import ComputeModel
from workers.model.runner_config import RunnerConfig


@dataclass(frozen=True)
class Reasoning:
    """The thinking markers (``reasoning`` in the config): as text, matched however the tokenizer splits
    them, or as exact ids; and the tokenizer that spells them."""

    start: str
    end: str
    start_token_ids: list[int] | None
    end_token_ids: list[int] | None
    tokenizer: str
    trust_remote_code: bool = False


@dataclass(frozen=True)
class SamplerSetup:
    """The sampler's processors and what their constructors get (vLLM's ``VllmConfig``; its model config's
    vocabulary and length are the runner's, filled once it loaded)."""

    engine_config: EngineConfig
    custom_processors: tuple[CustomProcessor, ...] = ()
    entry_points: bool = True
    grammar_cache_size: int = 256
    reasoning: Reasoning | None = None
    speculative: bool = False


@dataclass(frozen=True)
class Simulated:
    """``model.simulate``: a runner that loads no weights and sleeps a modelled step."""

    compute: ComputeModel
    vocab_size: int
    num_blocks: int | None = None


@dataclass(frozen=True)
class WorkerSetup:
    runner: RunnerConfig
    sampler: SamplerSetup
    max_num_seqs: int
    slots_per_worker: int
    async_scheduling: bool | None = None  # the pipelined step; None: decided by the device
    simulated: Simulated | None = None
    lock_timeout_s: float = 900.0

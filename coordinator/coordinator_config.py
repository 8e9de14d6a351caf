"""What the coordinator is built from: the model's facts, the KV geometry, and its settings.

All frozen: the coordinator never changes them, and a newcomer finds every knob here
instead of in a long constructor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from processors import SamplingParams

if TYPE_CHECKING:
    from workers.model.model_facts import ModelFacts


@dataclass(frozen=True)
class ModelInfo:
    """What the coordinator needs to know about the model (no weights)."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    generation_config: dict[str, Any]
    hf_config: Any = None  # the model's transformers config: the shapes a LoRA adapter must fit

    @classmethod
    def of(cls, facts: ModelFacts, tokenizer: Any, lora: bool = False) -> ModelInfo:
        """From the facts the run read once (``workers.model.model_facts``) and the loaded tokenizer. ``lora``:
        keep the model's config too, for checking adapters (reading it imports the model's config class,
        which a coordinator otherwise never does)."""
        eos = tokenizer.eos_token_id
        if eos is None:
            gen_eos = facts.generation_eos
            eos = gen_eos[0] if isinstance(gen_eos, list) and gen_eos else gen_eos
        return cls(
            vocab_size=facts.vocab_size,
            max_model_len=facts.max_model_len,
            eos_token_id=eos,
            generation_config={"eos_token_id": facts.generation_eos},
            hf_config=facts.hf_config if lora else None,
        )


@dataclass(frozen=True)
class KVSettings:
    """Block geometry the workers reported, and the scheduling knobs that depend on it."""

    num_blocks: int  # per worker
    block_size: int = 16
    prefix_caching: bool = True
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class CoordinatorConfig:
    """The coordinator's settings (``cluster.engine.setup`` fills them from the run's config)."""

    max_num_seqs: int
    num_workers: int
    rows_per_worker: int  # a worker's shard of the batch (scheduler.max_num_seqs_per_worker)
    kv: KVSettings
    seed: int = 0
    custom_processors: tuple[Any, ...] = ()  # user processors (specs), validated at admission
    processors_from_entry_points: bool = True
    consistency_check_every: int = 0  # audit the replicas every N steps (0: never)
    default_params: SamplingParams = field(default_factory=SamplingParams)
    reasoning_enabled: bool = False  # a reasoning section (thinking budgets) is configured
    grammar_cache_size: int = 256
    grammar_compile_timeout_s: float = 10.0  # structured_outputs.compile_timeout_s
    grammar_compile_max_memory: int = 2 << 30  # structured_outputs.compile_max_memory
    max_logprobs: int = 20
    group_by_prefix: bool = True  # input.group_by_prefix: one submitted batch queues by shared prompt prefix
    # Tokens a step is made a multiple of where it can be (the CPU's fixed linear row count: a step of 64
    # decode rows plus a prompt's 45 tokens would pad 20 rows; ``Scheduler``). 1: any count.
    step_multiple: int = 1
    # LoRA adapters per request (``lora``): whether they are served, the largest rank, and how many distinct
    # adapters one step may hold (a worker's device holds that many).
    lora_enabled: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1

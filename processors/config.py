"""The engine configuration a processor constructor receives.

Processors written for vLLM read ``vllm_config.scheduler_config.max_num_seqs``
and ``vllm_config.speculative_config``; this is the smallest object offering
those. Builtins use only these attributes, so any object that has them works.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3


@dataclass(frozen=True)
class ReasoningConfig:
    reasoning_start_token_ids: list[int] = field(default_factory=list)
    reasoning_end_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    max_model_len: int
    tokenizer: str | None = None  # path or hub id
    logprobs_mode: str = "raw_logprobs"  # vLLM's: raw_logprobs, or raw_logits (the values logprobs hold)

    def get_vocab_size(self) -> int:
        return self.vocab_size


@dataclass(frozen=True)
class EngineConfig:
    """What every processor constructor gets as its first argument."""

    scheduler_config: SchedulerConfig
    speculative_config: SpeculativeConfig | None = None
    model_config: ModelConfig | None = None
    reasoning_config: ReasoningConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def simple(cls, max_num_seqs: int, **kwargs: Any) -> EngineConfig:
        return cls(scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs), **kwargs)

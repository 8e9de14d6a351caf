"""A coordinator from a ``RaysampleConfig`` (``cluster.config``) and the KV blocks the workers hold."""

from __future__ import annotations

from typing import Any

from coordinator.coordinator import Coordinator
from coordinator.coordinator_config import CoordinatorConfig, KVSettings, ModelInfo
from coordinator.draft_policy import DraftPolicy
from coordinator.ngram_drafter import NgramDrafter
from processors import SamplingParams


def coordinator_inputs(config: Any, model_path: str) -> tuple[Any, ModelInfo]:
    """The tokenizer and the model's facts: what the coordinator loads, ready before the workers are."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        config.model.tokenizer or model_path, trust_remote_code=config.model.trust_remote_code
    )
    return tokenizer, ModelInfo.load(model_path, config.model.max_model_len, tokenizer, config.model.trust_remote_code)


def coordinator_from_config(config: Any, model_path: str, num_blocks: int, block_size: int,
                            inputs: tuple[Any, ModelInfo] | None = None) -> Coordinator:
    """Build from a ``RaysampleConfig`` (cluster.config) and the KV blocks each worker holds: no weights."""
    tokenizer, model = inputs if inputs is not None else coordinator_inputs(config, model_path)
    settings = CoordinatorConfig(
        max_num_seqs=config.scheduler.max_num_seqs,
        num_workers=config.cluster.num_workers,
        rows_per_worker=config.scheduler.slots_per_worker(),
        kv=KVSettings(
            num_blocks=num_blocks,
            block_size=block_size,
            prefix_caching=config.cache.enable_prefix_caching,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        ),
        seed=config.scheduler.seed,
        max_logprobs=config.model.max_logprobs,
        custom_processors=tuple(config.custom_processors()),
        consistency_check_every=config.scheduler.consistency_check_every,
        default_params=SamplingParams.from_dict(config.defaults),
        reasoning_enabled=config.reasoning is not None,
        processors_from_entry_points=config.processors_from_entry_points,
        grammar_cache_size=config.structured_outputs.grammar_cache_size,
        grammar_compile_timeout_s=config.structured_outputs.compile_timeout_s,
        grammar_compile_max_memory=config.structured_outputs.compile_max_memory,
    )
    spec = config.speculative
    if spec is None:
        return Coordinator(tokenizer, model, settings)
    drafter = NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return Coordinator(tokenizer, model, settings, drafter, DraftPolicy() if spec.draft_policy == "adaptive" else None)

"""A coordinator from a ``RaysampleConfig`` (``cluster.config``) and the KV blocks the workers hold."""

from __future__ import annotations

from typing import Any

from coordinator.coordinator import Coordinator
from coordinator.coordinator_config import CoordinatorConfig, KVSettings, ModelInfo
from coordinator.spec.draft_policy import DraftPolicy
from coordinator.spec.ngram_drafter import NgramDrafter
from processors import SamplingParams


def load_tokenizer(facts: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(facts.tokenizer, trust_remote_code=facts.trust_remote_code)


def shippable_tokenizer(facts: Any) -> Any | None:
    """The tokenizer, loaded where the run starts, for a coordinator in another process to unpickle: loading
    it there reads the model's config and imports transformers' model-loading code (about 1.3 s of CPU
    more than unpickling it). None for trust_remote_code, whose classes only their own loader imports."""
    return None if facts.trust_remote_code else load_tokenizer(facts)


def coordinator_inputs(config: Any, tokenizer: Any = None) -> tuple[Any, ModelInfo]:
    """The tokenizer (``tokenizer``, or loaded here) and what the coordinator needs of the model, ready
    before the workers are."""
    facts = config.facts
    tokenizer = load_tokenizer(facts) if tokenizer is None else tokenizer
    return tokenizer, ModelInfo.of(facts, tokenizer, lora=config.lora.enabled)


def step_multiple(config: Any) -> int:
    """The row count every CPU linear is called with (``model.cpu_row_tile``) where a single CPU worker computes
    every token of a step: steps that are a multiple of it pad nothing. 1 elsewhere (GPUs; several workers,
    whose shares of a step are their own)."""
    model = config.model
    cpu = config.cluster.gpus_per_worker == 0 and model.simulate is None
    single = config.cluster.num_workers == 1 and model.tensor_parallel_size == 1
    return model.cpu_row_tile if cpu and single and model.batch_invariant else 1


def coordinator_from_config(config: Any, num_blocks: int, block_size: int,
                            inputs: tuple[Any, ModelInfo] | None = None) -> Coordinator:
    """Build from a resolved ``RaysampleConfig`` (``cluster.config.resolve``) and the KV blocks each worker
    holds: no weights."""
    tokenizer, model = inputs if inputs is not None else coordinator_inputs(config)
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
        group_by_prefix=config.input.group_by_prefix,
        custom_processors=tuple(config.custom_processors()),
        consistency_check_every=config.scheduler.consistency_check_every,
        default_params=SamplingParams.from_dict(config.defaults),
        reasoning_enabled=config.reasoning is not None,
        processors_from_entry_points=config.processors_from_entry_points,
        grammar_cache_size=config.structured_outputs.grammar_cache_size,
        grammar_compile_timeout_s=config.structured_outputs.compile_timeout_s,
        grammar_compile_max_memory=config.structured_outputs.compile_max_memory,
        step_multiple=step_multiple(config),
        lora_enabled=config.lora.enabled,
        max_lora_rank=config.lora.max_lora_rank,
        max_loras=config.lora.max_loras,
    )
    spec = config.speculative
    if spec is None:
        return Coordinator(tokenizer, model, settings)
    drafter = NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return Coordinator(tokenizer, model, settings, drafter, DraftPolicy() if spec.draft_policy == "adaptive" else None)

"""The run's config turned into the typed records the layers below take: ``CoordinatorConfig`` for the
coordinator, ``WorkerSetup`` (with its ``RunnerConfig``) for a worker. Nothing below ``cluster`` reads the
config itself; this is the one place its fields are projected."""

from __future__ import annotations

from typing import Any

from cluster.config import RaysampleConfig
from coordinator.coordinator import Coordinator
from coordinator.coordinator_config import CoordinatorConfig, KVSettings, ModelInfo
from coordinator.spec.draft_policy import DraftPolicy
from coordinator.spec.ngram_drafter import NgramDrafter
from processors import SamplingParams
from workers.model.lora import LoraLimits
from workers.model.model_facts import ModelFacts
from workers.model.runner_config import RunnerConfig
from workers.step.worker_setup import Reasoning, SamplerSetup, Simulated, WorkerSetup


def load_tokenizer(facts: ModelFacts) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(facts.tokenizer, trust_remote_code=facts.trust_remote_code)


def shippable_tokenizer(facts: ModelFacts) -> Any | None:
    """The tokenizer, loaded where the run starts, for a coordinator in another process to unpickle: loading
    it there reads the model's config and imports transformers' model-loading code (about 1.3 s of CPU
    more than unpickling it). None for trust_remote_code, whose classes only their own loader imports."""
    return None if facts.trust_remote_code else load_tokenizer(facts)


def coordinator_inputs(config: RaysampleConfig, tokenizer: Any = None) -> tuple[Any, ModelInfo]:
    """The tokenizer (``tokenizer``, or loaded here) and what the coordinator needs of the model, ready
    before the workers are."""
    facts = config.facts
    tokenizer = load_tokenizer(facts) if tokenizer is None else tokenizer
    return tokenizer, ModelInfo.of(facts, tokenizer, lora=config.lora.enabled)


def step_multiple(config: RaysampleConfig) -> int:
    """Where a single CPU worker computes every token of a step, the step of the CPU linears' call sizes (the
    row ladder's multiples of ``model.cpu_smallest_row_tile`` up to ``model.cpu_row_tile``): a step of a
    multiple of it pads nothing where the worker's check kept the ladder (where it dropped sizes, the step is
    padded as before; the bits are the same either way). 1 elsewhere (GPUs; several workers, whose shares of
    a step are their own)."""
    model = config.model
    cpu = config.cluster.gpus_per_worker == 0 and model.simulate is None
    single = config.cluster.num_workers == 1 and model.tensor_parallel_size == 1
    return min(model.cpu_smallest_row_tile, model.cpu_row_tile) if cpu and single and model.batch_invariant else 1


def coordinator_config(config: RaysampleConfig, num_blocks: int, block_size: int) -> CoordinatorConfig:
    return CoordinatorConfig(
        max_num_seqs=config.scheduler.max_num_seqs,
        num_workers=config.cluster.num_workers,
        rows_per_worker=config.scheduler.slots_per_worker(),
        kv=KVSettings(num_blocks=num_blocks, block_size=block_size, prefix_caching=config.cache.enable_prefix_caching,
                      max_num_batched_tokens=config.scheduler.max_num_batched_tokens),
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


def coordinator_from_config(config: RaysampleConfig, num_blocks: int, block_size: int,
                            inputs: tuple[Any, ModelInfo] | None = None, kv_note: str | None = None) -> Coordinator:
    """The coordinator of a prepared run (``cluster.preflight.prepare_run``) over the KV blocks each worker
    holds: no weights. ``kv_note``: where the workers' KV budget came from (``cluster.memory``)."""
    tokenizer, model = inputs if inputs is not None else coordinator_inputs(config)
    settings = coordinator_config(config, num_blocks, block_size)
    spec = config.speculative
    if spec is None:
        coordinator = Coordinator(tokenizer, model, settings)
    else:
        drafter = NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        policy = DraftPolicy() if spec.draft_policy == "adaptive" else None
        coordinator = Coordinator(tokenizer, model, settings, drafter, policy)
    coordinator.kv_note = kv_note
    return coordinator


def runner_config(config: RaysampleConfig) -> RunnerConfig:
    facts, model, lora = config.facts, config.model, config.lora
    return RunnerConfig(
        model_path=str(facts.path), dtype=model.dtype, max_model_len=facts.max_model_len,
        trust_remote_code=facts.trust_remote_code, hf_config=facts.hf_config if model.simulate is None else None,
        prepack_cpu_weights=model.cpu_weight_prepack, block_size=config.cache.block_size,
        kv_cache_memory=config.cache.kv_cache_memory, gpu_memory_utilization=config.cache.gpu_memory_utilization,
        max_rows=config.scheduler.slots_per_worker(), decode_attention=model.decode_attention,
        tensor_parallel_size=model.tensor_parallel_size, enforce_eager=model.enforce_eager,
        cudagraph_capture_sizes=model.cudagraph_capture_sizes,
        max_step_tokens=config.scheduler.max_num_batched_tokens, batch_invariant=model.batch_invariant,
        row_tile=model.cpu_row_tile, smallest_row_tile=model.cpu_smallest_row_tile,
        lora=LoraLimits(lora.max_loras, lora.max_cpu_loras or lora.max_loras, lora.max_lora_rank)
        if lora.enabled else None)


def worker_setup(config: RaysampleConfig) -> WorkerSetup:
    """What every worker (and every tensor-parallel rank) of a prepared run is built from."""
    facts, reasoning, simulate = config.facts, config.reasoning, config.model.simulate
    markers = None if reasoning is None else Reasoning(
        reasoning.start, reasoning.end, reasoning.start_token_ids, reasoning.end_token_ids, facts.tokenizer,
        facts.trust_remote_code)
    sampler = SamplerSetup(
        engine_config=config.engine_config(str(facts.path), facts.vocab_size, facts.max_model_len),
        custom_processors=tuple(config.custom_processors()), entry_points=config.processors_from_entry_points,
        grammar_cache_size=config.structured_outputs.grammar_cache_size, reasoning=markers,
        speculative=config.speculative is not None)
    simulated = None if simulate is None else Simulated(
        simulate.compute_model(config.model.tensor_parallel_size), facts.vocab_size, simulate.num_blocks)
    return WorkerSetup(runner=runner_config(config), sampler=sampler, max_num_seqs=config.scheduler.max_num_seqs,
                       slots_per_worker=config.scheduler.slots_per_worker(),
                       async_scheduling=config.scheduler.async_scheduling, simulated=simulated,
                       lock_timeout_s=config.cache.lock_timeout_s)

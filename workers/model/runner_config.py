"""What a model runner is built from: one typed record, filled from the run's config by the cluster layer
(``cluster.engine.setup``) or given field by field by a test or a bench (``ModelRunner(path, device, ...)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.cpu.row_tiles import DEFAULT_SMALLEST, DEFAULT_TILE
from workers.model.lora import LoraLimits


@dataclass(frozen=True)
class RunnerConfig:
    """``spare_blocks``: blocks beyond the budget that no request gets, where a forward launched ahead writes
    the token of a row entering a block the coordinator has not yet given it (``workers.step.ahead``).
    ``tensor_parallel_size`` > 1: this process is one rank of a group that has joined its ``torch.distributed``
    group (``workers.model.tensor_parallel``). ``enforce_eager``: vLLM's switch for the fixed-shape decode
    forward (``workers.model.static_decode``): unset, CUDA graphs on CUDA and the variable-shape forward on CPU.
    ``merge_projections``: Llama-style layers in fewer operators (``workers.model.merged_layers``); unset,
    wherever the CPU's own fusion is not used. ``hf_config``: the Hugging Face config the run already read
    (``workers.model.model_facts``); None: read here. ``max_step_tokens``: the scheduler's token budget (the
    largest step a GPU's memory is set aside for). ``batch_invariant`` (CPU, one rank): every linear called with
    exactly ``row_tile`` rows or a checked smaller size down to ``smallest_row_tile`` (``workers.cpu.row_tiles``),
    and every query attended in the native kernel, so a row's bits depend neither on its batch nor on its
    prompt's chunking. ``lora``: serve LoRA adapters per request
    (``workers.model.lora``): each projection stays a module of its own, and steps run eager."""

    model_path: str
    dtype: str = "auto"
    max_model_len: int | None = None
    trust_remote_code: bool = False
    hf_config: Any = None  # transformers' PretrainedConfig
    prepack_cpu_weights: bool = True
    block_size: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_rows: int = 64
    verify: bool = True
    decode_attention: str = "auto"
    spare_blocks: int = 0
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    cudagraph_capture_sizes: list[int] | None = None
    merge_projections: bool | None = None
    max_step_tokens: int = 2048
    batch_invariant: bool = True
    row_tile: int = DEFAULT_TILE
    smallest_row_tile: int = DEFAULT_SMALLEST
    lora: LoraLimits | None = None

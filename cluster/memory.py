"""How much memory a CPU worker takes, decided before any worker starts.

A CPU worker's KV cache budget (``cache.kv_cache_memory``) comes from the memory of the node the
worker runs on, shared by every worker placed there, after their weights:

- ``cache.kv_cache_memory`` given: that, per worker;
- ``cache.gpu_memory_utilization`` given: that share of the node's memory for weights and KV
  caches together, as vLLM applies it to CPU memory;
- otherwise at most half of what the node has once its workers hold their weights, for all of
  its KV caches together (a CPU node is often a machine people also use);

and never more than every row at ``max_model_len`` needs. "What the node has" is the memory
Ray measured as available for tasks and actors when the node started, less what other actors
already hold (Ray's ``memory`` resource), or, in one process, the memory available now. A
budget the node cannot hold, or one that cannot hold one request of ``max_model_len``, stops
the start with one line naming the settings and the numbers. Each worker then asks Ray for its
weights, its KV cache and a runtime allowance as its ``memory``, so Ray never packs more
workers on a node than fit. GPU workers size their cache from their device (``ModelRunner``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.model.memory_plan import GpuMemoryPlan

GiB = 1 << 30
DEFAULT_SHARE = 0.5  # of the node's memory left after the weights, for all of its KV caches
# What a worker process holds besides weights and KV cache: torch, transformers, the tokenizer,
# activations of a step (measured here: 0.5-0.7 GiB of RSS for a small model).
RUNTIME_BYTES = 768 << 20


class MemoryPlanError(ValueError):
    """The memory asked for (or found) cannot serve the model; the message names what to change."""


@dataclass(frozen=True)
class ModelMemory:
    """What one worker's copy of the model costs, from its config alone (no weights loaded)."""

    weights: int  # bytes of the parameters in the runtime dtype
    kv_per_token: int  # bytes of K and V for one token, all layers
    max_model_len: int

    @classmethod
    def of(cls, facts: Any, dtype: str) -> ModelMemory:
        """From the model's facts (``workers.model.model_facts``) and its safetensors headers when the
        model is a plain local directory (milliseconds: this runs on the driver before any worker
        starts); else from a model built on the meta device (seconds: the model's code is imported)."""
        fast = None if facts.trust_remote_code else _from_files(facts, dtype)
        return fast if fast is not None else cls.built_on_meta(facts, dtype)

    def per_rank(self, size: int) -> ModelMemory:
        """One rank's share in a tensor-parallel group of ``size``: the linears, embeddings and KV heads
        split evenly (the norms, kept whole on every rank, are a rounding error next to them)."""
        return ModelMemory(-(-self.weights // size), self.kv_per_token // size, self.max_model_len)

    @classmethod
    def built_on_meta(cls, facts: Any, dtype: str) -> ModelMemory:
        import torch
        from transformers import AutoModelForCausalLM

        from workers.model.runner_options import resolve_dtype
        from workers.model.model_support import kv_geometry

        torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
        size = torch.empty(0, dtype=torch_dtype).element_size()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(facts.hf_config, trust_remote_code=facts.trust_remote_code)
        weights = sum(p.numel() for p in model.parameters()) * size
        layers, kv_heads, head_dim = kv_geometry(facts.hf_config)
        return cls(weights, 2 * layers * kv_heads * head_dim * size, facts.max_model_len)


_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                      "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_RUNTIME_BYTES_PER_ELEMENT = {"float32": 4, "auto": 4, "bfloat16": 2, "float16": 2}  # "auto" is float32 on CPU


def _from_files(facts: Any, dtype: str) -> ModelMemory | None:
    """The weights' size from the safetensors headers, without importing torch; None when the files do
    not say it plainly (no safetensors, a dtype or tensor type not listed here)."""
    from workers.model.model_support import kv_geometry

    weights = sorted(Path(facts.path).glob("*.safetensors"))
    size = _RUNTIME_BYTES_PER_ELEMENT.get(dtype)
    if not weights or size is None:
        return None
    elements = 0
    for file in weights:
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            width = _SAFETENSORS_BYTES.get(tensor["dtype"])
            if width is None:
                return None
            start, end = tensor["data_offsets"]
            elements += (end - start) // width
    layers, kv_heads, head_dim = kv_geometry(facts.hf_config)
    return ModelMemory(elements * size, 2 * layers * kv_heads * head_dim * size, facts.max_model_len)


@dataclass(frozen=True)
class MemoryPlan:
    """Every worker's KV budget and what it asks Ray for; ``note`` says where the budget came from."""

    kv_cache_memory: int
    worker_memory: int
    note: str


def node_memory_now() -> int:
    """Memory available on this host now (for an engine in this process)."""
    import psutil

    return int(psutil.virtual_memory().available)


def sized_by_memory(config: Any) -> bool:
    """CPU workers that hold weights: their KV budget comes from the node (GPU ones size it from the device)."""
    return config.cluster.gpus_per_worker == 0 and config.model.simulate is None


def with_memory_plan(config: Any, plan: MemoryPlan) -> Any:
    """``config`` with the plan's KV budget, and its Ray memory per worker unless the user set one."""
    cache = config.cache.model_copy(update={"kv_cache_memory": plan.kv_cache_memory})
    cluster = config.cluster
    if cluster.memory_per_worker is None:
        cluster = cluster.model_copy(update={"memory_per_worker": plan.worker_memory})
    return config.model_copy(update={"cache": cache, "cluster": cluster})


def plan_in_process(config: Any) -> tuple[Any, str | None]:
    """The config an in-process engine runs (every worker in this process) and where its budget came from."""
    if not sized_by_memory(config):
        return config, None
    model = ModelMemory.of(config.facts, config.model.dtype)
    plan = plan_cpu_memory(config, model, node_memory_now(), config.cluster.num_workers, "in this process")
    return with_memory_plan(config, plan), plan.note


def plan_cpu_memory(config: Any, model: ModelMemory, node_memory: int, workers_on_node: int,
                    where: str = "on the node") -> MemoryPlan:
    """The KV budget of each CPU worker when ``workers_on_node`` of them share ``node_memory`` bytes."""
    rows = config.scheduler.slots_per_worker()
    one_request = model.max_model_len * model.kv_per_token
    _refuse_too_large(config, model, one_request, node_memory, where)
    each = "per rank" if config.model.tensor_parallel_size > 1 else "per worker"  # a rank holds its heads' share
    every_row = rows * one_request
    weights = workers_on_node * model.weights
    cache = config.cache
    node = f"{_gib(node_memory)} available {where}"
    if cache.kv_cache_memory is not None:
        kv, note = cache.kv_cache_memory, "given (cache.kv_cache_memory)"
        need = workers_on_node * (kv + model.weights + RUNTIME_BYTES)
        if need > node_memory:
            raise MemoryPlanError(
                f"cache.kv_cache_memory={_gib(kv)} {each} is more than the node holds: {workers_on_node} "
                f"worker(s) x ({_gib(kv)} KV + {_gib(model.weights)} weights + {_gib(RUNTIME_BYTES)} runtime) = "
                f"{_gib(need)}, with {node}; lower cache.kv_cache_memory or cluster.num_workers, or leave "
                "cache.kv_cache_memory unset to size it from the node")
    else:
        if "gpu_memory_utilization" in cache.model_fields_set:
            share, how = cache.gpu_memory_utilization, f"cache.gpu_memory_utilization={cache.gpu_memory_utilization:g} of"
            total = share * node_memory - weights
        else:
            share, how = DEFAULT_SHARE, "half of"
            total = share * (node_memory - weights)
        kv = max(0, int(total // workers_on_node))
        note = (f"computed: {how} the {node} once its {workers_on_node} worker(s) hold their weights "
                f"({_gib(model.weights)} each), shared by them")
        if kv > every_row:
            kv, note = every_row, note + f"; capped by {rows} rows at max_model_len={model.max_model_len}"
    if kv < one_request:
        raise MemoryPlanError(
            f"a KV cache of {_gib(kv)} {each} ({note}) holds {kv // max(model.kv_per_token, 1)} tokens; one "
            f"request of model.max_model_len={model.max_model_len} needs {one_request // model.kv_per_token} "
            f"({_gib(one_request)} at {model.kv_per_token} bytes a token): lower model.max_model_len, or raise "
            "cache.kv_cache_memory (or give the node more memory)")
    return MemoryPlan(kv, model.weights + kv + RUNTIME_BYTES, f"{_gib(kv)} {each}, {note}")


def _refuse_too_large(config: Any, model: ModelMemory, one_request: int, node_memory: int, where: str) -> None:
    """A rank whose weights and runtime do not fit a node alone: name the tensor-parallel size
    whose ranks would, each on a node of its own, with one request's KV cache besides."""
    if model.weights + RUNTIME_BYTES <= node_memory:
        return
    size = config.model.tensor_parallel_size
    room = node_memory - RUNTIME_BYTES
    needed = -(-(model.weights + one_request) * size // room) if room > 0 else None
    rank = f"one rank of {size}" if size > 1 else "one worker"
    advice = (f"set model.tensor_parallel_size to at least {needed} (a size that divides the model's attention "
              "heads), its ranks on separate nodes" if needed is not None else "use nodes with more memory")
    raise MemoryPlanError(
        f"the model does not fit: {rank} needs {_gib(model.weights)} of weights + {_gib(RUNTIME_BYTES)} runtime, "
        f"with {_gib(node_memory)} available {where}; {advice}")


def check_weights_fit_device(model: ModelMemory, size: int, device_bytes: int, utilization: float) -> None:
    """A GPU rank whose share of the weights is more than ``cache.gpu_memory_utilization`` of its
    device is refused before it loads any, naming the tensor-parallel size that would fit."""
    budget = int(device_bytes * utilization)
    share = model.per_rank(size).weights
    if share <= budget:
        return
    needed = -(-model.weights // budget) if budget > 0 else None
    rank = f"each of {size} ranks holds" if size > 1 else "one GPU holds"
    raise MemoryPlanError(
        f"the model does not fit: {rank} {_gib(share)} of weights, and "
        f"cache.gpu_memory_utilization={utilization:g} of a {_gib(device_bytes)} GPU is {_gib(budget)}; set "
        f"model.tensor_parallel_size to at least {needed} (a size that divides the model's attention heads)")


def check_device_memory(config: Any, device: Any) -> None:
    """Before this actor's GPU loads any weight: ``check_weights_fit_device``, then the whole plan as
    estimated from the config (``gpu_memory_plan``), so a start that cannot fit says so with the numbers
    instead of failing minutes later (nothing to check on CPU: the plan did)."""
    if getattr(device, "type", "cpu") != "cuda" or config.model.simulate is not None:
        return
    import torch

    model = ModelMemory.of(config.facts, gpu_dtype(config))
    _, total = torch.cuda.mem_get_info(device)
    check_weights_fit_device(model, config.model.tensor_parallel_size, total, config.cache.gpu_memory_utilization)
    if config.cache.kv_cache_memory is None:
        gpu_memory_plan(config, total, model).check()


def gpu_dtype(config: Any) -> str:
    return "bfloat16" if config.model.dtype == "auto" else config.model.dtype  # auto is bfloat16 on CUDA


def gpu_memory_plan(config: Any, device_bytes: int, model: ModelMemory | None = None) -> GpuMemoryPlan:
    """One worker's GPU memory as planned before loading (``workers.model.memory_plan``): its share of the
    weights (from the files or the meta device), the largest step's activations estimated from the config,
    and the KV cache of what is left. ``config`` is resolved (``config.facts``)."""
    from workers.model.memory_plan import GpuMemoryPlan, estimated_activations, kv_block_bytes

    dtype = gpu_dtype(config)
    size = config.model.tensor_parallel_size
    model = (model or ModelMemory.of(config.facts, dtype)).per_rank(size)
    dtype_bytes = _RUNTIME_BYTES_PER_ELEMENT[dtype] if dtype != "auto" else 2
    block_size = config.cache.block_size or 16
    facts = config.facts
    scheduler = config.scheduler
    rows = scheduler.slots_per_worker()
    drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    tokens = max(scheduler.max_num_batched_tokens, rows * (1 + drafts))
    activations = estimated_activations(facts.hf_config, tokens, rows * (1 + drafts), dtype_bytes,
                                        -(-facts.max_model_len // block_size))
    return GpuMemoryPlan(device_bytes, config.cache.gpu_memory_utilization, model.weights + RUNTIME_BYTES,
                         activations, kv_block_bytes(facts.hf_config, block_size, dtype_bytes, size), block_size,
                         facts.max_model_len)


def _gib(value: float) -> str:
    return f"{value / GiB:.2f} GiB" if value >= GiB else f"{value / 2**20:.1f} MiB"

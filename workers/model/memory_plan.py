"""A GPU's memory, planned as vLLM plans it (``gpu_memory_utilization``): the weights, then the
activations and graphs of the largest step a worker runs, then the KV cache from what is left.

The largest step is bounded by the scheduler's token budget and the decode graphs' largest capture
size, never by rows x ``max_model_len``: attention reads each row's keys where they lie (FlexAttention
over the pool, ``workers.model.flex_paged``), so no step gathers a row's context. The runner measures
the activations on the device (``ModelRunner._activation_reserve``); before any weight is loaded the same
plan is estimated from the model's config on the meta device (``estimated_activations``), so a start
that cannot fit says so in one line, with the numbers and the ``max_model_len`` that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GiB = 1 << 30


class GpuMemoryError(ValueError):
    """The model cannot start on this device with these settings; the message is one line with the numbers."""


def _gib(value: float) -> str:
    return f"{value / GiB:.2f} GiB" if abs(value) >= GiB else f"{value / 2**20:.1f} MiB"


@dataclass(frozen=True)
class GpuMemoryPlan:
    device_bytes: int
    utilization: float
    weights: int  # the weights (and whatever else the process or others hold on the device when measured)
    activations: int  # the largest step's activations and the graphs' buffers
    per_block: int  # bytes of one KV block, every layer
    block_size: int
    max_model_len: int

    @property
    def budget(self) -> int:
        return int(self.device_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return max(self.budget - self.weights - self.activations, 0)

    @property
    def num_blocks(self) -> int:
        return self.kv_bytes // self.per_block

    @property
    def longest(self) -> int:
        """The longest sequence the KV cache holds (a multiple of the block size)."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (f"cache.gpu_memory_utilization={self.utilization:g} of a {_gib(self.device_bytes)} GPU is "
                f"{_gib(self.budget)}: {_gib(self.weights)} of weights, {_gib(self.activations)} for the largest "
                f"step's activations and graphs, {_gib(self.kv_bytes)} of KV cache = {self.num_blocks} blocks of "
                f"{self.block_size} tokens ({_gib(self.per_block)} each)")

    def check(self) -> GpuMemoryPlan:
        """This plan, or ``GpuMemoryError`` when its KV cache cannot hold one sequence of ``max_model_len``."""
        needed = -(-self.max_model_len // self.block_size)
        if self.num_blocks >= needed:
            return self
        fits = f"max_model_len={self.longest} would fit" if self.longest >= self.block_size else \
            "no context fits beside the weights: use more GPUs (model.tensor_parallel_size)"
        raise GpuMemoryError(f"the KV cache cannot hold one sequence of max_model_len={self.max_model_len} "
                             f"({_gib(needed * self.per_block)}): {self.describe()}; {fits}, or raise "
                             "cache.gpu_memory_utilization")


def kv_block_bytes(hf_config: Any, block_size: int, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    from workers.model.model_support import kv_geometry

    layers, kv_heads, head_dim = kv_geometry(hf_config)
    return 2 * layers * block_size * (kv_heads // tensor_parallel_size) * head_dim * dtype_bytes


def estimated_activations(hf_config: Any, max_tokens: int, max_logit_rows: int, dtype_bytes: int,
                          max_table_blocks: int, graph_rows: int = 256) -> int:
    """A bound on one step's transient device memory, from the config alone: the hidden states and the
    projections of ``max_tokens`` tokens (a layer's q/k/v, MLP and residual live at once), the logits of
    the rows that sample (in the model's dtype and in float32 for the sampler), and FlexAttention's block
    mask (an int per head and table entry for each query tile: a graph's ``graph_rows`` rows of one query,
    or a prompt chunk's tiles of 128). Measured on the device, the runner uses the measurement; this is
    what the plan can say before anything loads."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", heads)
    intermediate = getattr(hf_config, "intermediate_size", 4 * hidden)
    per_token = (4 * hidden + (heads + 2 * kv_heads) * head_dim + 3 * intermediate) * dtype_bytes
    logits = max_logit_rows * hf_config.vocab_size * (dtype_bytes + 4)
    block_mask = (graph_rows + -(-max_tokens // 128)) * heads * max_table_blocks * 4 * 2
    return max_tokens * per_token + logits + block_mask

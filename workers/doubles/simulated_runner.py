"""A runner that models a GPU's step time instead of computing: for scaling studies on CPUs.

Each ``forward`` takes a modelled compute time (a fixed part per step plus a part per
token fed) and returns logits that are a pure function of each row's last token and
position (the counter-based hash the sampler uses), so the real sampler, processors and
coordinator run on them and a request's tokens do not depend on which worker, or how many,
ran it. Waiting takes no CPU: many such workers on Ray actors show what the coordinator,
Ray and the lockstep cost when the compute is on GPUs.

As on a GPU, a launch returns at once and only reading the result waits: ``forward`` returns
the logits as soon as they are made and the modelled step ends at ``ready_at``, which
``wait_ready`` waits for (steps run one after another, as on one device). Making the logits
(hashing every vocabulary entry of every row: ~4 ms of CPU for 64 rows of 8k) and sampling them
are the device's work, as on a GPU the logits and the sampler's tensors live there: the worker
samples before it waits, so both happen within the modelled time, and their CPU is counted
apart (``device_cpu_s``), not as the worker's host CPU. The model adds no time for sampling
itself (a GPU samples 64 rows in a fraction of a millisecond), nor for launching kernels.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.sample.counter_rng import gumbel, stream_base

LOGIT_SALT = 0x51  # the simulated model's own stream, apart from the sampler's


@dataclass(frozen=True)
class ComputeModel:
    """Step seconds = ``fixed_s + per_token_s * tokens fed``; ``layers`` and ``hidden`` size the
    all-reduces of a tensor-parallel split."""

    fixed_s: float
    per_token_s: float
    layers: int = 32
    hidden: int = 4096

    def step_seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def split(self, size: int, allreduce_latency_s: float, allreduce_bytes_per_s: float,
              bytes_per_value: int = 2) -> ComputeModel:
        """One rank of a tensor-parallel group of ``size``: 1/size of the weights read and of the FLOPs,
        plus two all-reduces a layer (after attention and after the MLP), each a fixed latency and a
        ring's ``2 (size - 1) / size`` of each token's hidden vector over the link."""
        if size == 1:
            return self
        allreduces = 2 * self.layers
        per_token = allreduces * 2 * (size - 1) / size * self.hidden * bytes_per_value / allreduce_bytes_per_s
        return ComputeModel(self.fixed_s / size + allreduces * allreduce_latency_s,
                            self.per_token_s / size + per_token, self.layers, self.hidden)

    @classmethod
    def roofline(cls, params: float, bytes_per_param: float, memory_bytes_per_s: float, flops_per_s: float,
                 utilization: float, layers: int = 32, hidden: int = 4096) -> ComputeModel:
        """Weights read once per step (memory-bound part); 2 FLOPs per parameter per token fed at
        ``utilization`` of peak (compute-bound part)."""
        return cls(params * bytes_per_param / memory_bytes_per_s, 2 * params / (flops_per_s * utilization), layers,
                   hidden)


# Llama-3-8B in bfloat16 on one H100 SXM: 3.35 TB/s HBM, 989 TFLOP/s dense bf16 at 50%:
# 4.8 ms a step plus 32 µs a token fed; 32 layers of 4096.
PRESETS: dict[str, ComputeModel] = {
    "llama-8b-h100": ComputeModel.roofline(8.03e9, 2, 3.35e12, 989e12, 0.5, layers=32, hidden=4096),
}


class SimulatedRunner:
    """Stands in for ``ModelRunner``: modelled time, placement-independent logits, no weights."""

    def __init__(self, compute: ComputeModel, vocab_size: int, max_model_len: int, num_blocks: int,
                 block_size: int = 16, device: torch.device | str = "cpu", sleep: Any = time.sleep,
                 spare_blocks: int = 0) -> None:
        self.compute = compute
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.spare_blocks = list(range(num_blocks, num_blocks + spare_blocks))  # as ModelRunner's
        self.block_size = block_size
        self.device = torch.device(device)
        self.sleep = sleep
        self.simulated_s = 0.0  # modelled compute so far
        self.device_cpu_s = 0.0  # CPU spent on the device's work (making and sampling logits, on the host here)
        self.ready_at = 0.0  # perf_counter time the last modelled step ends
        self._vocab = torch.arange(vocab_size, device=self.device)

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """No KV to move: the logits depend only on each row's last token and position."""

    def forward(self, rows: Sequence[Any]) -> torch.Tensor:
        """Logits for the last ``num_logits`` positions of each row, in row order, at once; the
        modelled step ends at ``ready_at``, after the one before it."""
        fed = sum(len(row.token_ids) for row in rows)
        seconds = self.compute.step_seconds(fed)
        self.simulated_s += seconds
        self.ready_at = max(time.perf_counter(), self.ready_at) + seconds
        start_cpu = time.thread_time()
        logits = self._logits(rows)
        self.device_cpu_s += time.thread_time() - start_cpu
        return logits

    def wait_ready(self) -> None:
        """Until the last modelled step ends: reading its results (the sampled tokens) waits for it."""
        self.sleep(max(0.0, self.ready_at - time.perf_counter()))

    def _logits(self, rows: Sequence[Any]) -> torch.Tensor:
        last_tokens, positions = [], []
        for row in rows:
            n = len(row.token_ids)
            for i in range(n - row.num_logits, n):
                last_tokens.append(row.token_ids[i])
                positions.append(row.start_pos + i)
        if not last_tokens:
            return torch.empty(0, self.vocab_size, device=self.device)
        base = stream_base(torch.tensor(last_tokens, device=self.device),
                           torch.tensor(positions, device=self.device), LOGIT_SALT)
        # Gumbel noise over the vocabulary, sharpened so that the distribution has a clear peak.
        return gumbel(base.unsqueeze(1), self._vocab.unsqueeze(0)) * 2.0

"""A model runner that loads no weights: random logits for the rows asked.

For tests and benchmarks of everything around the model (the coordinator, plan
application, processors, sampling), at sizes no real model fits on this machine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch


class RandomLogitsRunner:
    """Stands in for ``ModelRunner``: ``forward`` returns one row of random logits per logit asked."""

    block_size = 16

    def __init__(self, vocab_size: int, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.seconds = 0.0  # spent in forward, so callers can leave the stand-in out of their timings

    def forward(self, rows: Sequence[Any]) -> torch.Tensor:
        start = time.perf_counter()
        count = sum(row.num_logits for row in rows)
        out = torch.randn(count, self.vocab_size, generator=self.generator, device=self.device)
        self.seconds += time.perf_counter() - start
        return out

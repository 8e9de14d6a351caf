"""What the engine counts: steps, tokens, speculative decoding, throughput."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from coordinator.rates import WindowedRate


@dataclass
class EngineMetrics:
    steps: int = 0
    generated_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    prefill_tokens: int = 0  # tokens computed for prompts (and recomputed outputs), not decode tokens
    prompt_tokens: int = 0  # tokens of the prompts given (once per sequence: n per request): prefill_tokens less what the cache saved
    # The pipelined step: rows whose logits came from the forward a worker launched before the plan,
    # and rows that forward computed which the plan did not keep (finished, preempted, moved).
    ahead_rows: int = 0
    ahead_wasted_rows: int = 0
    started: float = field(default_factory=time.monotonic)
    generation_rate: WindowedRate = field(default_factory=WindowedRate)  # output tokens/s, last 10 s

    @property
    def spec_acceptance(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

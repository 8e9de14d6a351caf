"""The engine's metrics in Ray's metrics system, scraped from each node's Prometheus endpoint.

Names are prefixed ``raysample_`` (Ray adds ``ray_``); every series is tagged with the
engine's coordinator name and the model, so several engines on one cluster stay apart.
"""

from __future__ import annotations

from collections.abc import Iterable

from ray.util.metrics import Counter, Gauge, Histogram

from coordinator.request import RequestOutput

STEP_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class EngineRayMetrics:
    def __init__(self, engine: str, model: str) -> None:
        tags = ("engine", "model")
        self._tags = {"engine": engine, "model": model}
        self.requests = Counter("raysample_requests_finished", "Requests finished, by finish reason",
                                tag_keys=(*tags, "finish_reason"))
        self.generated = Counter("raysample_generated_tokens", "Output tokens generated", tag_keys=tags)
        self.prefill = Counter("raysample_prefill_tokens", "Prompt (and recomputed) tokens computed", tag_keys=tags)
        self.prompt = Counter("raysample_prompt_tokens", "Prompt tokens given (computed or found in the prefix cache)",
                              tag_keys=tags)
        self._prompt_exported = 0
        self.spec_proposed = Counter("raysample_spec_proposed_tokens", "Draft tokens proposed", tag_keys=tags)
        self.spec_accepted = Counter("raysample_spec_accepted_tokens", "Draft tokens accepted", tag_keys=tags)
        self.step_time = Histogram("raysample_step_seconds", "Wall time of one engine step", boundaries=STEP_SECONDS,
                                   tag_keys=tags)
        self.running = Gauge("raysample_requests_running", "Requests being generated", tag_keys=tags)
        self.waiting = Gauge("raysample_requests_waiting", "Requests queued for admission", tag_keys=tags)
        self.kv_usage = Gauge("raysample_kv_cache_usage", "Fraction of KV cache blocks in use", tag_keys=tags)
        self.tokens_per_s = Gauge("raysample_generation_tokens_per_second", "Output tokens/s over the last 10 s",
                                  tag_keys=tags)
        for metric in (self.requests, self.generated, self.prefill, self.prompt, self.spec_proposed, self.spec_accepted,
                       self.step_time, self.running, self.waiting, self.kv_usage, self.tokens_per_s):
            metric.set_default_tags(self._tags)

    def record_prompt_tokens(self, total: int) -> None:
        """The coordinator's running total of prompt tokens given (requests arrive between steps too)."""
        if total > self._prompt_exported:
            self.prompt.inc(total - self._prompt_exported)
            self._prompt_exported = total

    def record_step(self, step_s: float, generated: int, prefill: int, proposed: int, accepted: int) -> None:
        self.step_time.observe(step_s)
        for counter, value in ((self.generated, generated), (self.prefill, prefill),
                               (self.spec_proposed, proposed), (self.spec_accepted, accepted)):
            if value:
                counter.inc(value)

    def record_load(self, running: int, waiting: int, kv_usage: float, tokens_per_s: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.tokens_per_s.set(tokens_per_s)

    def record_finished(self, outputs: Iterable[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                reason = "error" if out.error else (out.finish_reason.value if out.finish_reason else "unknown")
                self.requests.inc(1, tags={"finish_reason": reason})

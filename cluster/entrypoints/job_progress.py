"""What a job counts and shows while it runs: counters, a progress bar or log lines, the start line."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from cluster.config import RaysampleConfig


SHOWN_ERRORS = 5  # error reasons the job's summary prints, with their line numbers


@dataclass
class JobCounters:
    total_lines: int
    skipped: int = 0  # already in the output (resume)
    done: int = 0
    errors: int = 0
    retryable: int = 0  # of the errors, the engine's own failures: a resumed run retries them
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    first_result: float | None = None
    first_errors: list[str] = field(default_factory=list)  # "line N (id X): why", for the summary

    def rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)

    def error(self, line_no: int, rid: object, reason: str) -> None:
        """Count an error record; the first few are shown with their line numbers when the job ends."""
        self.errors += 1
        if len(self.first_errors) < SHOWN_ERRORS:
            shown = reason if len(reason) <= 300 else reason[:297] + "..."
            self.first_errors.append(f"line {line_no}" + ("" if rid is None else f" (id {rid!r})") + f": {shown}")


def describe_start(config: RaysampleConfig, local: bool) -> str:
    """What is being started, said before the seconds it takes."""
    model, cluster = config.model, config.cluster
    name = model.display_name()
    if local:
        return f"{name} in this process (--local)"
    device = f"{cluster.gpus_per_worker:g} GPU" if cluster.gpus_per_worker else f"{cluster.cpus_per_worker:g} CPU"
    if cluster.address == "local" and os.environ.get("RAY_ADDRESS"):
        where = "the Ray job's cluster"
    elif cluster.address == "local":
        where = "a private Ray instance"
    else:
        where = f"the Ray cluster at {cluster.address}"
    engines = f"{cluster.num_engines} engines x " if cluster.num_engines > 1 else ""
    if model.tensor_parallel_size > 1:
        return (f"{name} on {engines}{cluster.num_workers} worker(s) x {model.tensor_parallel_size} tensor-parallel "
                f"ranks of {device} each, on {where}")
    return f"{name} on {engines}{cluster.num_workers} worker(s) of {device} each, on {where}"


class Progress:
    """A tqdm bar on a terminal, log lines every ``every_s`` otherwise."""

    def __init__(self, counters: JobCounters, every_s: float) -> None:
        self.counters = counters
        self.every_s = every_s
        self.last_log = time.monotonic()
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=counters.total_lines, initial=counters.skipped, unit="req", dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        c = self.counters
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(tok_s=f"{c.rate():.0f}", errors=c.errors)
        elif time.monotonic() - self.last_log >= self.every_s:
            self.last_log = time.monotonic()
            finished = c.done + c.errors + c.skipped
            left = c.total_lines - finished
            per_req = (time.monotonic() - c.started) / max(c.done + c.errors, 1)
            print(f"[raysample] {finished}/{c.total_lines} requests, {c.rate():.0f} tokens/s, "
                  f"ETA {left * per_req:.0f}s, {c.errors} errors", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

"""Where a step's time goes, summed over an engine's steps: for bench/scale_out.py's own-core model.

CPU seconds are per thread (``time.thread_time``): what a process would take from a core of
its own. On a machine where the engine's processes share few cores their wall times grow with
the contention; their CPU times do not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.wire import StepResult


@dataclass
class StepProfile:
    steps: int = 0
    wall_s: float = 0.0  # as measured, plan to results accepted
    coordinator_cpu_s: float = 0.0  # the step loop's CPU on the critical path (overlapped output work excluded)
    worker_wall_s: float = 0.0  # the slowest worker's step, as measured
    worker_cpu_s: float = 0.0  # the slowest worker's host CPU
    simulated_s: float = 0.0  # the longest modelled compute
    own_core_worker_s: float = 0.0  # the slowest worker's host CPU + modelled compute
    straggler_s: float = 0.0  # that, less the workers' mean: what uneven shards cost

    def add(self, wall_s: float, coordinator_cpu_s: float, results: Sequence[StepResult]) -> None:
        if not results:
            return
        own = [r.cpu_s + r.simulated_s for r in results]
        self.steps += 1
        self.wall_s += wall_s
        self.coordinator_cpu_s += coordinator_cpu_s
        self.worker_wall_s += max(r.compute_s for r in results)
        self.worker_cpu_s += max(r.cpu_s for r in results)
        self.simulated_s += max(r.simulated_s for r in results)
        self.own_core_worker_s += max(own)
        self.straggler_s += max(own) - sum(own) / len(own)

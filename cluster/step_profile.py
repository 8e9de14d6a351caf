"""Where a step's time goes, summed over an engine's steps: for bench/scale_out.py's own-core model.

CPU seconds are per thread (``time.thread_time``): what a process would take from a core of
its own. On a machine where the engine's processes share few cores their wall times grow with
the contention; their CPU times do not.

A step on cores of their own: each worker's host CPU on the critical path, then its compute;
in the pipelined step the forward launched ahead runs while the coordinator accepts and plans
(its CPU ``C``), the plan crosses to the worker and back (the idle round trip ``RT``) and the
worker applies it (its overlapped CPU), so that part costs the longer of the two:

    worker i: cpu_i - overlap_i + max(ahead_i, C + RT + overlap_i) + (compute_i - ahead_i)
    step:     the slowest worker

Synchronously (nothing launched ahead) that is ``C + RT + cpu_i + compute_i``.
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
    own_core_s: float = 0.0  # the whole step on cores of their own (the module's model)
    ahead_s: float = 0.0  # the slowest worker's compute launched ahead (overlapped with planning)
    overlap_cpu_s: float = 0.0  # the slowest worker's CPU applying the plan while that ran
    round_trip_s: float = 0.0  # an idle call to a worker and back, measured once at start-up

    def add(self, wall_s: float, coordinator_cpu_s: float, results: Sequence[StepResult]) -> None:
        if not results:
            return
        own = [r.cpu_s + r.simulated_s for r in results]
        front = coordinator_cpu_s + self.round_trip_s
        self.own_core_s += max(r.cpu_s - r.overlap_cpu_s + max(r.ahead_s, front + r.overlap_cpu_s)
                               + r.simulated_s - r.ahead_s for r in results)
        self.ahead_s += max(r.ahead_s for r in results)
        self.overlap_cpu_s += max(r.overlap_cpu_s for r in results)
        self.steps += 1
        self.wall_s += wall_s
        self.coordinator_cpu_s += coordinator_cpu_s
        self.worker_wall_s += max(r.compute_s for r in results)
        self.worker_cpu_s += max(r.cpu_s for r in results)
        self.simulated_s += max(r.simulated_s for r in results)
        self.own_core_worker_s += max(own)
        self.straggler_s += max(own) - sum(own) / len(own)

"""Where a step's time goes, summed over an engine's steps: for bench/scale_out.py's own-core model.

CPU seconds are per thread (``time.thread_time``): what a process would take from a core of
its own. On a machine where the engine's processes share few cores their wall times grow with
the contention; their CPU times do not.

A step on cores of their own: each worker's host CPU on the critical path, then its compute;
in the pipelined step the forward launched ahead runs while the coordinator accepts and plans
(its CPU ``C``), the plan crosses to the worker and back (the idle round trip ``RT``) and the
worker applies it to its mirror (its overlapped CPU ``O``). Then the step's own forward starts,
and the processors' replicas take the BatchUpdate (``U``) while it runs. So for worker i, with
``F = C + RT + O`` and ``R`` the compute still to run once the plan is applied:

    R_i    = max(ahead_i - F_i, 0) + (compute_i - ahead_i)
    step_i = F_i + max(R_i, U_i) + (cpu_i - O_i - U_i)
    step   = the slowest worker

Synchronously (nothing launched ahead, ``O`` counted in the rest of the CPU) that is
``C + RT + max(compute_i, U_i) + cpu_i - U_i``.
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
    update_cpu_s: float = 0.0  # the slowest worker's processors' update_state, while its forward ran
    round_trip_s: float = 0.0  # an idle call to a worker and back, measured once at start-up

    def add(self, wall_s: float, coordinator_cpu_s: float, results: Sequence[StepResult]) -> None:
        if not results:
            return
        own = [r.timings.cpu_s + r.timings.simulated_s for r in results]
        front = coordinator_cpu_s + self.round_trip_s
        self.own_core_s += max(_own_core_step(r, front) for r in results)
        self.ahead_s += max(r.timings.ahead_s for r in results)
        self.overlap_cpu_s += max(r.timings.overlap_cpu_s for r in results)
        self.update_cpu_s += max(r.timings.update_cpu_s for r in results)
        self.steps += 1
        self.wall_s += wall_s
        self.coordinator_cpu_s += coordinator_cpu_s
        self.worker_wall_s += max(r.timings.compute_s for r in results)
        self.worker_cpu_s += max(r.timings.cpu_s for r in results)
        self.simulated_s += max(r.timings.simulated_s for r in results)
        self.own_core_worker_s += max(own)
        self.straggler_s += max(own) - sum(own) / len(own)


def _own_core_step(r: StepResult, front: float) -> float:
    t = r.timings
    applied = front + t.overlap_cpu_s
    still_computing = max(t.ahead_s - applied, 0.0) + t.simulated_s - t.ahead_s
    return applied + max(still_computing, t.update_cpu_s) + t.cpu_s - t.overlap_cpu_s - t.update_cpu_s

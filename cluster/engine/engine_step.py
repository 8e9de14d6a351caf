"""One engine step, the same in-process and on Ray: plan -> executor runs it -> coordinator
accepts -> outputs.

The coordinator plans (``Coordinator.next_plan``), the executor fans the plan out to
the workers and gathers their ``StepResult``s, the coordinator accepts the sampled
tokens (``Coordinator.accept_step``) and builds outputs (``take_outputs``), which go
to ``publish``. With ``overlap_outputs`` the previous step's outputs are built while
the workers compute. ``lock`` guards the coordinator from callers on other threads
(the Ray engine's actor calls); it is released while the workers compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from cluster.engine.audit import check_consistency
from cluster.engine.executor import Executor, StepFailure, WorkersLost
from coordinator.coordinator import Coordinator
from coordinator.intake.quarantine import EngineFault
from coordinator.request import RequestOutput
from workers.wire import StepPlan, StepResult

Publish = Callable[[list[RequestOutput]], None]

ALL_WORKERS_GONE = "all raysample workers are gone; pending requests cannot be served"


class AllWorkersGone(EngineFault):
    def __init__(self) -> None:
        super().__init__(ALL_WORKERS_GONE)


@dataclass(frozen=True)
class StepDone:
    plan: StepPlan
    results: list[StepResult]
    seconds: float  # wall time, plan to accepted tokens
    coordinator_cpu_s: float  # this thread's CPU on the step's critical path (overlapped output work excluded)


def step(coordinator: Coordinator, executor: Executor, publish: Publish,
         lock: AbstractContextManager | None = None, overlap_outputs: bool = False
         ) -> StepDone | StepFailure | None:
    """Run one step. None: nothing to run. A ``StepFailure``: the step failed and is handled
    (only the requests it convicts fail, the others are re-admitted). Raises ``EngineFault`` when the
    engine itself is broken (``AllWorkersGone`` when no worker is left), ``ConsistencyError`` when
    audited replicas diverged."""
    lock = lock if lock is not None else nullcontext()
    if coordinator.convictions_pending():  # a failure convicted requests: is the engine sound?
        problem = executor.self_check()
        with lock:
            coordinator.settle_convictions(problem)
            publish(coordinator.take_outputs())
    with lock:
        started, started_cpu = time.perf_counter(), time.thread_time()
        plan = coordinator.next_plan()
        if plan is None:
            return None
    pending = executor.launch(plan)
    planned_cpu = time.thread_time()
    if overlap_outputs:
        with lock:  # while the workers compute
            publish(coordinator.take_outputs())
            coordinator.decode_ahead()
    overlapped_cpu = time.thread_time() - planned_cpu
    outcome = executor.collect(plan, pending)
    if not isinstance(outcome, list):
        recover(coordinator, executor, outcome, publish, lock)
        return outcome
    if any(result.model_faults for result in outcome):
        # The model's own logits were NaN or +inf: a request's doing, or the engine's? The engine's when
        # it no longer computes its start-up probe; then no request of the step is failed for it.
        problem = executor.self_check()
        if problem is not None:
            raise EngineFault(f"the engine is broken, not the requests it ran: {problem}")
    with lock:
        if plan.audit:
            check_consistency(plan.step, outcome)
        coordinator.accept_step(plan, outcome)
        if not overlap_outputs:
            publish(coordinator.take_outputs())
    return StepDone(plan, outcome, time.perf_counter() - started,
                    time.thread_time() - started_cpu - overlapped_cpu)


def recover(coordinator: Coordinator, executor: Executor, failure: StepFailure, publish: Publish,
            lock: AbstractContextManager) -> None:
    """Fail what the failure convicts (``coordinator.intake.quarantine``), re-admit every other running
    request with the tokens it has, and bring the workers back: reset, or replaced when lost.
    The workers are replaced outside ``lock``: callers are served while replacements load."""
    with lock:
        if isinstance(failure, WorkersLost):
            alive = [i for i in executor.worker_ids if i not in failure.workers]
            probing = coordinator.worker_failed(failure.workers, failure.cause, alive)
        else:
            coordinator.fail_step(failure.rows, f"step failed: {failure.message}", executor.worker_ids)
        publish(coordinator.take_outputs())
    if isinstance(failure, WorkersLost):
        executor.replace(failure.workers, counted=not probing)  # suspects apart: the request's fault
    else:
        executor.reset()
    with lock:
        if not executor.worker_ids:
            raise AllWorkersGone()
        coordinator.scheduler.set_workers(executor.worker_ids)
        publish(coordinator.take_outputs())

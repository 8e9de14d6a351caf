"""What runs a step on the workers: the one interface the step loop sees.

Two implementations: ``InProcessExecutor`` (workers are objects in this process)
and ``RayExecutor`` (worker actors, plain calls or a compiled graph). The step
(``cluster.engine.engine_step``) never knows which one it drives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.wire import StepPlan, StepResult


@dataclass(frozen=True)
class WorkersLost:
    """Workers died or did not answer within ``cluster.call_timeout_s``: they must be replaced."""

    workers: list[int]
    cause: str


@dataclass(frozen=True)
class StepRaised:
    """A worker raised (a processor, the sampler, the model); ``rows``: the rows whose processor
    raised, when known. The workers are alive and only need a reset."""

    rows: Sequence[int] | None
    message: str


StepFailure = WorkersLost | StepRaised


class Executor(ABC):
    """Runs plans on the live workers and replaces the ones that are lost."""

    @property
    @abstractmethod
    def worker_ids(self) -> list[int]:
        """The live workers' indices (each owns a fixed shard of the batch's rows), ascending."""

    @abstractmethod
    def launch(self, plan: StepPlan) -> Any:
        """Start ``plan`` on every live worker without waiting for it."""

    @abstractmethod
    def collect(self, plan: StepPlan, pending: Any) -> list[StepResult] | StepFailure:
        """The launched step's results (in worker order), or what went wrong."""

    @abstractmethod
    def replace(self, lost: Sequence[int], counted: bool) -> None:
        """Drop ``lost`` workers, reset the others and start replacements while
        ``cluster.max_worker_replacements`` lasts (``counted=False``: the failure was a request's,
        found while running suspects apart; it uses up no budget)."""

    @abstractmethod
    def reset(self) -> None:
        """Clear every worker's batch state after a step that raised (the requests are re-admitted)."""

    @abstractmethod
    def self_check(self) -> str | None:
        """Whether every live worker still computes its start-up probe (``Worker.self_check``): None if so,
        else one line naming the first worker that does not, and why. Asked before a failure that every
        request shared is blamed on a request."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers."""

"""The consistency audit: every worker's mirror and processor replicas must agree."""

from __future__ import annotations

from collections.abc import Sequence

from workers.wire import StepResult


class ConsistencyError(RuntimeError):
    """Replicas disagree; the message names the worker, the row or the processor."""


def check_consistency(step: int, results: Sequence[StepResult]) -> None:
    """Compare every worker's digests with worker ``results[0]``'s."""
    if len(results) < 2:
        return
    ref = results[0]
    for other in results[1:]:
        if other.row_digests is None or ref.row_digests is None:
            raise ConsistencyError(f"step {step}: worker {other.worker_id} returned no digest")
        if len(other.row_digests) != len(ref.row_digests):
            raise ConsistencyError(
                f"step {step}: worker {other.worker_id} mirrors {len(other.row_digests)} rows, "
                f"worker {ref.worker_id} mirrors {len(ref.row_digests)}"
            )
        for row, (a, b) in enumerate(zip(ref.row_digests, other.row_digests)):
            if a != b:
                raise ConsistencyError(
                    f"step {step}: worker {other.worker_id} disagrees with worker {ref.worker_id} on batch row {row}"
                )
        for name, digest in (ref.processor_digests or {}).items():
            theirs = (other.processor_digests or {}).get(name)
            if theirs != digest:
                raise ConsistencyError(
                    f"step {step}: worker {other.worker_id} disagrees with worker {ref.worker_id} "
                    f"on the state of processor {name}"
                )

"""The coordinator actor: hosts the ``cluster.ray.step_loop.StepLoop`` and forwards to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ray


@ray.remote(max_concurrency=64)
class CoordinatorActor:
    """Hosts the ``cluster.ray.step_loop.StepLoop`` step loop; many callers at once."""

    def __init__(self, config: Any, placement: Any = None, workers: list[Any] | None = None,
                 kv_note: str | None = None, tokenizer: Any = None) -> None:
        from cluster.quiet import quiet_libraries, quiet_teardown
        from cluster.ray.startup_heap import collection_paused

        with collection_paused():  # until the step loop freezes the start-up heap
            from cluster.ray.step_loop import StepLoop

            quiet_teardown()
            quiet_libraries()
            self.loop = StepLoop(config, placement, workers, kv_note, tokenizer)

    def ready(self) -> bool:
        return True

    def add_requests(self, items: list[tuple[Any, Any, str | None]], final_only: bool = False) -> list[str]:
        return self.loop.add_requests(items, final_only)

    def abort(self, request_id: str) -> bool:
        return self.loop.abort(request_id)

    def poll(self, request_ids: list[str], timeout_s: float, finished_only: bool = False) -> list[Any]:
        return self.loop.poll(request_ids, timeout_s, finished_only)

    def stream(self, request_id: str, wait_s: float = 30.0) -> Iterator[Any]:
        """A Ray streaming generator: each output as soon as the step loop publishes it."""
        while True:
            for out in self.loop.poll([request_id], wait_s):
                yield out
                if out.finished:
                    return

    def stats(self) -> dict[str, Any]:
        return self.loop.stats()

    def worker_handles(self) -> list[Any]:
        return self.loop.worker_handles()

    def shutdown(self) -> None:
        self.loop.shutdown()

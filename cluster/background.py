"""Start-up work that can run while something slower (workers loading) is under way."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def in_background(fn: Callable[..., Any], *args: Any, name: str = "raysample-background") -> Future:
    """``fn(*args)`` on a daemon thread; its result, or its exception, through the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised by future.result()
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class SerialThread:
    """Calls run one after another on one daemon thread: a call that never returns holds that thread
    only, never the interpreter's exit (``ThreadPoolExecutor`` threads are joined at exit, so one
    stuck call kept a finished job's process alive)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._calls.put((fn, future))
        return future

    def stop(self) -> None:
        """The thread ends after the call it is running, if any (it is not waited for)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised by future.result()
                future.set_exception(exc)

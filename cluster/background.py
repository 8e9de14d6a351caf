"""Start-up work that can run while something slower (workers loading) is under way."""

from __future__ import annotations

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

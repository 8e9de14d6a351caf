"""Windowed rates: what the engine does now, not a lifetime average diluted by idle time."""

from __future__ import annotations

import time
from collections import deque


class WindowedRate:
    """Events per second over the last ``window_s`` seconds (or since the first event, if sooner)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, count))
        self._total += count
        self._expire(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._expire(now)
        if not self._events:
            return 0.0
        # Span: the window, or the time since the oldest event still in it when the engine started later.
        span = min(self.window_s, max(now - self._events[0][0], 1e-3))
        return self._total / span

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._total -= self._events.popleft()[1]

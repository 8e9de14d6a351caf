"""Freezing an engine process's start-up heap (``cluster.startup_heap``): garbage is collected first,
never frozen, and what is allocated afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

from cluster.startup_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other = self  # a cycle: only the cyclic collector frees it


def test_garbage_is_collected_before_the_freeze_and_later_cycles_still_are():
    before = _Node()
    dead = weakref.ref(before)
    del before
    try:
        assert freeze_startup_heap() > 0
        assert dead() is None  # collected, not frozen for ever
        after = _Node()
        later = weakref.ref(after)
        del after
        gc.collect()
        assert later() is None  # the collector still runs on what comes after
    finally:
        gc.unfreeze()  # this test process is not an engine's own

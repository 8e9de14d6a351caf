"""Freezing an engine process's start-up heap (``cluster.startup_heap``): garbage is collected first,
never frozen, and what is allocated afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

from cluster.startup_heap import collection_paused, freeze_startup_heap


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


def test_the_collector_is_paused_for_a_constructor_and_runs_again_however_it_ends():
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with collection_paused():
            raise RuntimeError("a failed constructor")
    except RuntimeError:
        pass
    assert gc.isenabled()
    gc.disable()  # paused by someone else: left as it was
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()

"""Freezing an engine process's start-up heap (``cluster.ray.startup_heap``): what is tracked at the freeze
is never collected (start-up garbage included, by choice: collecting it cost more than it frees), and
what is allocated afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

from cluster.ray.startup_heap import collection_paused, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other = self  # a cycle: only the cyclic collector frees it


def test_start_up_garbage_is_frozen_with_the_rest_and_later_cycles_are_still_collected():
    gc.collect()  # this test process's own garbage so far: only the cycle below is left at the freeze
    before = _Node()
    dead = weakref.ref(before)
    del before
    try:
        assert freeze_startup_heap() > 0
        gc.collect()
        assert dead() is not None  # frozen: kept for the process's life, as documented
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

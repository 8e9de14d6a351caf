"""A wave of admissions (every row of a 16-GPU engine at once) costs O(rows), not O(rows x workers)
or O(rows x columns) in Python, and decides exactly what the per-row code decided.

- ``RowColumns`` applies a BatchUpdate column by column; here against the row-by-row reference.
- ``OwnerPicker`` picks the admission owner from a heap; here against a scan of every worker.
- A worker applies the BatchUpdate to its processors while its forward runs: sampling sees the
  same state, and the profile counts that CPU as overlapped.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.step_profile import StepProfile
from coordinator.kv_blocks import KVCacheManager
from coordinator.schedule.owner_choice import OwnerPicker
from coordinator.schedule.scheduler import Scheduler
from processors import BatchUpdate, MoveDirectionality, SamplingParams
from processors.row_columns import RowColumns
from workers.wire import StepResult, StepTimings

COLUMNS = {"temperature": (np.float32, 1.0), "key": (np.int64, 0), "greedy": (np.bool_, True),
           "output": (object, None)}
MAX_ROWS = 12


def values_of(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> dict | None:
    """Like the stages': some requests bring no values, some only a few columns, lists in object columns."""
    if params.seed % 5 == 0:
        return None
    if params.seed % 5 == 1:
        return {"key": params.seed}
    return {"temperature": params.temperature, "key": params.seed, "greedy": params.temperature < 0.1,
            "output": output}


class ReferenceColumns:
    """RowColumns as it was: every remove, add and move one row at a time."""

    def __init__(self) -> None:
        self.arrays = {name: np.full(MAX_ROWS, default, dtype=dtype) for name, (dtype, default) in COLUMNS.items()}

    def update(self, update: BatchUpdate) -> None:
        for row in update.removed:
            self._reset(row)
        for row, params, prompt, output in update.added:
            values = values_of(params, prompt, output)
            self._reset(row)
            for name, value in (values or {}).items():
                self.arrays[name][row] = value
        for a, b, direction in update.moved:
            for name, array in self.arrays.items():
                value_a = array[a]
                array[a] = array[b] if direction == MoveDirectionality.SWAP else COLUMNS[name][1]
                array[b] = value_a

    def _reset(self, row: int) -> None:
        for name, array in self.arrays.items():
            array[row] = COLUMNS[name][1]


rows = st.integers(0, MAX_ROWS - 1)
added = st.tuples(rows, st.integers(0, 10**6), st.floats(0.0, 2.0, width=32), st.lists(st.integers(0, 9), max_size=3))
updates = st.lists(st.tuples(st.lists(rows, max_size=4), st.lists(added, max_size=6),
                             st.lists(st.tuples(rows, rows, st.sampled_from(list(MoveDirectionality))), max_size=8)),
                   min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(updates=updates)
def test_row_columns_apply_a_batch_update_as_row_by_row_code_does(updates):
    """Removes, adds (a row added twice in one update included: the later wins) and moves in any
    order and overlap, over several updates."""
    columns, reference = RowColumns(MAX_ROWS, COLUMNS), ReferenceColumns()
    for removed, adds, moved in updates:
        update = BatchUpdate(MAX_ROWS, removed,
                             [(row, SamplingParams(temperature=t, seed=seed), [1, 2], output)
                              for row, seed, t, output in adds],
                             [(a, b, d) for a, b, d in moved if a != b])
        columns.update(update, values_of)
        reference.update(update)
        for name, array in reference.arrays.items():
            got = columns[name]
            if array.dtype == object:
                assert [x for x in got] == [x for x in array], name  # lists kept as elements, the same ones
                assert all(g is r for g, r in zip(got, array)), name
            else:
                np.testing.assert_array_equal(got, array, err_msg=name)


def scheduler(workers: int, limit: int) -> Scheduler:
    kv = KVCacheManager(workers, num_blocks=16, block_size=4, prefix_caching=False)
    return Scheduler(limit * workers, workers, limit, 1 << 20, kv)


def least_loaded_by_scan(s: Scheduler) -> int | None:
    """The rule, spelled as a scan: fewest running requests, then most free blocks, then the lowest id."""
    live = [w for w in sorted(s.alive) if s.load[w] < s.rows_per_worker]
    return min(live, key=lambda w: (s.load[w], -s.kv.pools[w].num_free, w), default=None)
changes = st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["admit", "allocate", "free", "pick"]),
                             st.integers(1, 5)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(workers=st.integers(1, 6), limit=st.integers(1, 4), dead=st.sets(st.integers(0, 5), max_size=3),
       start_load=st.lists(st.integers(0, 4), min_size=6, max_size=6),
       start_used=st.lists(st.integers(0, 16), min_size=6, max_size=6), steps=changes)
def test_the_owner_heap_picks_what_the_scan_picks(workers, limit, dead, start_load, start_used, steps):
    """Ties on load break on free blocks, then the lowest id; full and dead workers never come up;
    after any mix of admissions, allocations and frees that the admission loop reports."""
    s = scheduler(workers, limit)
    s.alive = set(range(workers)) - dead
    held = {w: [] for w in range(workers)}
    for w in range(workers):
        s.load[w] = min(start_load[w], limit)
        held[w] = s.kv.pools[w].allocate(start_used[w])
    picker = OwnerPicker(s)
    assert picker.pick() == least_loaded_by_scan(s)
    for worker, change, count in steps:
        worker %= workers
        if change == "admit" and s.load[worker] < limit:
            s.load[worker] += 1
        elif change == "allocate":
            held[worker] += s.kv.pools[worker].allocate(min(count, s.kv.pools[worker].num_free))
        elif change == "free" and held[worker]:
            s.kv.pools[worker].release(held[worker][-count:])
            del held[worker][-count:]
        picker.touched(worker)
        assert picker.pick() == least_loaded_by_scan(s)


def test_the_profile_counts_update_state_as_overlapped_with_the_forward_it_ran_beside():
    """Own-core step of one worker: F = coordinator + round trip + plan applied; then the longer of the
    compute still to run and the processors' update_state; then the rest of the worker's CPU."""
    profile = StepProfile(round_trip_s=0.001)
    # pipelined: 6 ms launched ahead covers 3 + 1 + 0.5; 50 ms of prefill after it hides 10 ms of update_state
    timings = StepTimings(cpu_s=0.012, simulated_s=0.056, ahead_s=0.006, overlap_cpu_s=0.0005, update_cpu_s=0.010)
    profile.add(0.1, 0.003, [StepResult(0, 1, (0, 1), timings=timings)])
    assert abs(profile.own_core_s - (0.006 + 0.050 + 0.0015)) < 1e-12
    # synchronous, nothing to hide it: update_state longer than the compute sets the pace
    profile = StepProfile(round_trip_s=0.001)
    timings = StepTimings(cpu_s=0.011, simulated_s=0.002, update_cpu_s=0.010)
    profile.add(0.1, 0.003, [StepResult(0, 1, (0, 1), timings=timings)])
    assert abs(profile.own_core_s - (0.004 + 0.010 + 0.001)) < 1e-12
    # without update_state it is the model the profile always had
    profile = StepProfile(round_trip_s=0.001)
    timings = StepTimings(cpu_s=0.002, simulated_s=0.007, ahead_s=0.006, overlap_cpu_s=0.0005)
    profile.add(0.1, 0.003, [StepResult(0, 1, (0, 1), timings=timings)])
    assert abs(profile.own_core_s - (0.002 - 0.0005 + max(0.006, 0.0045) + 0.001)) < 1e-12

"""The batched n-gram drafter proposes exactly what the per-row search proposes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import coordinator.spec.ngram_batch as ngram_batch
from coordinator.spec.ngram_batch import BatchNgramDrafter, NgramMap
from coordinator.spec.ngram_drafter import NgramDrafter

steps = st.lists(  # per step: (row, tokens accepted, room) for some rows; or a row re-admitted
    st.tuples(st.integers(0, 5), st.lists(st.integers(0, 6), max_size=4), st.integers(-1, 5), st.booleans()),
    min_size=1, max_size=40,
)


def run(seed_rows: list[list[int]], events, k: int, min_n: int, max_n: int) -> None:
    search = NgramDrafter(k, min_n, max_n)
    batch = BatchNgramDrafter(search, slots=len(seed_rows), width=4)  # a small width: the history grows
    tokens = [list(r) for r in seed_rows]
    for slot, row in enumerate(tokens):
        batch.admit(slot, row)
    for row, new, room, readmit in events:
        if readmit:
            batch.release(row)
            batch.admit(row, tokens[row])
        batch.append(np.array([row]), np.array([len(new)]), np.array(new, dtype=np.int32))
        tokens[row].extend(new)
        slots = np.arange(len(tokens))
        rooms = np.full(len(tokens), room)
        counts, flat = batch.propose(slots, rooms)
        at = 0
        for slot, count in enumerate(counts.tolist()):
            assert flat[at : at + count].tolist() == search.propose(tokens[slot], room), (slot, tokens[slot])
            at += count


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 6), max_size=12), min_size=6, max_size=6), events=steps,
       k=st.integers(1, 4), n=st.sampled_from([(1, 1), (1, 3), (2, 3), (2, 5)]))
def test_batched_drafts_equal_the_search(rows, events, k, n):
    run(rows, events, k, *n)


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 6), max_size=12), min_size=6, max_size=6), events=steps)
def test_hash_collisions_fall_back_to_the_search(rows, events):
    """Every n-gram of a length gets one key: lookups hit the wrong n-gram and are caught."""
    original = ngram_batch.ngram_keys
    ngram_batch.ngram_keys = lambda windows: np.zeros(windows.shape, dtype=np.int64)
    try:
        run(rows, events, 3, 1, 3)
    finally:
        ngram_batch.ngram_keys = original


def test_map_keeps_the_last_value_and_grows():
    m = NgramMap(capacity=8)
    uids = np.arange(1000, dtype=np.int64) % 7
    keys = np.arange(1000, dtype=np.int64) // 7
    m.put(uids, keys, np.arange(1000, dtype=np.int32))
    m.put(uids[:10], keys[:10], np.full(10, -5, dtype=np.int32))
    got = m.get(uids, keys)
    assert got[:10].tolist() == [-5] * 10 and got[10:].tolist() == list(range(10, 1000))
    assert m.get(np.array([99]), np.array([0])).tolist() == [-1]
    assert m.capacity >= 2000

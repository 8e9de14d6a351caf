"""The persistent batch reproduces the seed's algorithm and worked examples."""

from __future__ import annotations

import pytest
from helpers import apply_update_to_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from processors import MoveDirectionality, SamplingParams

UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP


def entry(rid: str) -> BatchEntry:
    return BatchEntry(rid, SamplingParams(), [1, 2], [])


def batch_of(*ids: str) -> PersistentBatch:
    batch = PersistentBatch(max_num_reqs=8)
    batch.update([], [entry(r) for r in ids])
    batch.take_update()
    return batch


def test_seed_example_fewer_new_than_finished():
    batch = batch_of("A", "B", "C", "D")
    e = entry("E")
    batch.update(["A", "C"], [e])
    batch.swap(0, 1)
    update = batch.take_update()
    assert update.batch_size == 3
    assert [(i, p, pr, o) for i, p, pr, o in update.added] == [(0, e.params, e.prompt_token_ids, e.output_token_ids)]
    assert update.added[0][3] is e.output_token_ids  # passed by reference
    assert list(update.removed) == [2]
    assert list(update.moved) == [(3, 2, UNI), (0, 1, SWAP)]
    assert batch.request_ids() == ["B", "E", "D"]


def test_seed_example_more_new_than_finished():
    batch = batch_of("A", "B", "C", "D")
    batch.update(["C"], [entry("E"), entry("F")])
    batch.swap(0, 1)
    update = batch.take_update()
    assert update.batch_size == 5
    assert [a[0] for a in update.added] == [2, 4]
    assert list(update.removed) == []
    assert list(update.moved) == [(0, 1, SWAP)]
    assert batch.request_ids() == ["B", "A", "E", "D", "F"]


def test_no_change_gives_none():
    batch = batch_of("A", "B")
    batch.update([], [])
    assert batch.take_update() is None


def test_removed_are_descending_and_condense_moves_pair_lowest_empty_with_highest_full():
    batch = batch_of("A", "B", "C", "D", "E", "F")
    batch.update(["A", "C", "D"], [])
    update = batch.take_update()
    assert list(update.removed) == [3, 2, 0]
    assert list(update.moved) == [(5, 0, UNI), (4, 2, UNI)]
    assert update.batch_size == 3
    assert batch.request_ids() == ["F", "B", "E"]


def test_errors_name_the_problem():
    batch = batch_of("A")
    with pytest.raises(KeyError, match="not in the batch"):
        batch.update(["Z"], [])
    with pytest.raises(ValueError, match="already in the batch"):
        batch.update([], [entry("A")])
    with pytest.raises(ValueError, match="max_num_reqs=8"):
        batch.update([], [entry(str(i)) for i in range(8)])
    batch.update([], [])
    with pytest.raises(RuntimeError, match="twice"):
        batch.update([], [])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_churn_matches_replayed_updates(data):
    """Replaying every BatchUpdate on a plain list always gives the batch's own layout."""
    capacity = data.draw(st.integers(1, 10))
    batch = PersistentBatch(capacity)
    replay: list = []
    counter = 0
    for _ in range(data.draw(st.integers(1, 25))):
        live = batch.request_ids()
        finished = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        room = capacity - len(live) + len(finished)
        n_new = data.draw(st.integers(0, room))
        arrivals = [entry(f"r{counter + i}") for i in range(n_new)]
        counter += n_new
        batch.update(finished, arrivals)
        for _ in range(data.draw(st.integers(0, 3))):
            if batch.num_reqs >= 2:
                i = data.draw(st.integers(0, batch.num_reqs - 1))
                j = data.draw(st.integers(0, batch.num_reqs - 1))
                batch.swap(i, j)
        update = batch.take_update()
        if update is not None:
            # Adds refill freed rows from the lowest, and extend only once none is left.
            assert list(update.removed) == sorted(update.removed, reverse=True)
            if update.removed:
                assert all(a[0] < min(update.removed) for a in update.added)
        replay = apply_update_to_rows(replay, update, lambda p, pr, o: o)
        assert len(replay) == batch.num_reqs
        assert all(out is e.output_token_ids for out, e in zip(replay, batch.entries()))

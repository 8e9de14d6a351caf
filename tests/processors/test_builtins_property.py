"""Builtins under random churn equal a per-row reference; process_dict_updates equals a rebuild."""

from __future__ import annotations

import random

import torch
from helpers import VOCAB, engine_config, reference_logit_bias, reference_min_p, reference_min_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from processors import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    SamplingParams,
    process_dict_updates,
)

params_strategy = st.builds(
    SamplingParams,
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0]),
    logit_bias=st.one_of(
        st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5, allow_nan=False), max_size=4)
    ),
    min_tokens=st.sampled_from([0, 0, 1, 3, 6]),
    max_tokens=st.just(50),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3),
)


def _new_entry(rid: str, params: SamplingParams, eos: int | None) -> BatchEntry:
    params.update_from_generation_config({}, eos)
    return BatchEntry(rid, params, [1, 2, 3], [])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_builtins_match_per_row_reference_under_churn(data):
    capacity = data.draw(st.integers(1, 12))
    config = engine_config(capacity)
    procs = {
        "min_p": MinPLogitsProcessor(config, torch.device("cpu"), False),
        "logit_bias": LogitBiasLogitsProcessor(config, torch.device("cpu"), False),
        "min_tokens": MinTokensLogitsProcessor(config, torch.device("cpu"), False),
    }
    references = {
        "min_p": lambda row, e: reference_min_p(row, e.params),
        "logit_bias": lambda row, e: reference_logit_bias(row, e.params),
        "min_tokens": lambda row, e: reference_min_tokens(row, e.params, e.output_token_ids),
    }
    batch = PersistentBatch(capacity)
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    counter = 0
    for _ in range(data.draw(st.integers(1, 20))):
        live = batch.request_ids()
        finished = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        n_new = data.draw(st.integers(0, capacity - len(live) + len(finished)))
        arrivals = [
            _new_entry(f"r{counter + i}", data.draw(params_strategy), data.draw(st.sampled_from([None, 0])))
            for i in range(n_new)
        ]
        counter += n_new
        batch.update(finished, arrivals)
        for _ in range(data.draw(st.integers(0, 2))):
            if batch.num_reqs >= 2:
                batch.swap(rng.randrange(batch.num_reqs), rng.randrange(batch.num_reqs))
        update = batch.take_update()
        for proc in procs.values():
            proc.update_state(update)
        logits = torch.randn(batch.num_reqs, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        for name, proc in procs.items():
            got = proc.apply(logits.clone())
            want = torch.stack([references[name](logits[i], e) for i, e in enumerate(batch.entries())]) if batch.num_reqs else logits
            assert torch.equal(got, want), name
            # Any shard through apply_rows gives the same rows.
            if batch.num_reqs:
                lo = rng.randrange(batch.num_reqs)
                hi = rng.randrange(lo, batch.num_reqs) + 1
                shard = proc.apply_rows(logits[lo:hi].clone(), slice(lo, hi))
                assert torch.equal(shard, want[lo:hi]), f"{name} shard {lo}:{hi}"
        for e in batch.entries():  # one token generated per live request
            e.output_token_ids.append(rng.randrange(VOCAB))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_process_dict_updates_equals_rebuild_from_scratch(data):
    capacity = data.draw(st.integers(1, 10))
    batch = PersistentBatch(capacity)
    state: dict[int, int] = {}
    counter = 0

    def new_state(params, prompt, output):
        return params.extra_args["tag"] if params.extra_args else None

    for _ in range(data.draw(st.integers(1, 20))):
        live = batch.request_ids()
        finished = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        n_new = data.draw(st.integers(0, capacity - len(live) + len(finished)))
        arrivals = []
        for _ in range(n_new):
            tagged = data.draw(st.booleans())
            arrivals.append(
                BatchEntry(f"r{counter}", SamplingParams(extra_args={"tag": counter} if tagged else None), [], [])
            )
            counter += 1
        batch.update(finished, arrivals)
        for _ in range(data.draw(st.integers(0, 3))):
            if batch.num_reqs >= 2:
                batch.swap(data.draw(st.integers(0, batch.num_reqs - 1)), data.draw(st.integers(0, batch.num_reqs - 1)))
        changed = process_dict_updates(state, batch.take_update(), new_state)
        rebuilt = {
            row: e.params.extra_args["tag"] for row, e in enumerate(batch.entries()) if e.params.extra_args
        }
        assert state == rebuilt
        assert isinstance(changed, bool)


def test_process_dict_updates_none_is_no_change():
    state = {0: "x"}
    assert process_dict_updates(state, None, lambda *a: "y") is False
    assert state == {0: "x"}


def test_min_tokens_spec_decode_masks_only_positions_below_min():
    config = engine_config(4)
    proc = MinTokensLogitsProcessor(config, torch.device("cpu"), False)
    p0 = SamplingParams(min_tokens=3, stop_token_ids=[5])
    p1 = SamplingParams(min_tokens=0, stop_token_ids=[5])
    out0: list[int] = [7]
    batch = PersistentBatch(4)
    batch.update([], [BatchEntry("a", p0, [1], out0), BatchEntry("b", p1, [1], [])])
    proc.update_state(batch.take_update())
    logits = torch.zeros(3 + 2, VOCAB)  # request a owns rows 0..2, b owns rows 3..4
    proc.apply_with_spec_decode(logits, [3, 2])
    masked_rows = [r for r in range(5) if logits[r, 5] == float("-inf")]
    assert masked_rows == [0, 1]  # len(out)=1, min 3: positions 0 and 1 still below

"""Speculative decoding keeps custom processors exact: update_state(None) per draft position, and
each processor restored to its pre-draft state after verification (see LogitsProcessor's docstring)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import engine_config
from spec_processors import LengthGateProcessor, VllmMinTokensCopy

from cluster.engine.local_engine import LocalEngine
from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from processors import SamplingParams
from workers.sample.rejection import verify_drafts
from workers.sample.sampler import Sampler

VOCAB = 16
PROCESSORS = ["spec_processors:LengthGateProcessor", "spec_processors:VllmMinTokensCopy"]
PROMPTS = [
    "a b c d a b c d a b c d a b c d",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1 2 3 1 2 3 1 2 3 1 2",
    "café café café",
    "Hello there Hello there Hello there",
    "x y x y x y x y",
]
ARRIVAL_STEP = [0, 0, 2, 3, 5, 9]


def config(spec: int, workers: int = 1) -> dict:
    base = {"model": {"tiny": "loopy", "max_model_len": 256},
            "scheduler": {"max_num_seqs": 4, "consistency_check_every": 1},
            "cluster": {"num_workers": workers}, "processors": PROCESSORS}
    if spec:
        base["speculative"] = {"num_speculative_tokens": spec, "draft_policy": "fixed"}
    return base


def favourite_tokens() -> list[int]:
    """Each prompt's most frequent greedy token: banning it for a while changes the output."""
    outs = LocalEngine(config(0)).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    return [Counter(o.token_ids).most_common(1)[0][0] for o in outs]


@pytest.fixture(scope="module")
def params() -> list[SamplingParams]:
    fav = favourite_tokens()
    out = []
    for i, tok in enumerate(fav):
        extra = {"gate": [tok, 6 + 3 * i]} if i % 2 == 0 else {"vmin": [7 + 2 * i, tok]}
        out.append(SamplingParams(temperature=0.0, max_tokens=30 + 3 * i, ignore_eos=True, extra_args=extra))
    return out


def run(engine: LocalEngine, params: list[SamplingParams]) -> list[list[int]]:
    """Staggered arrivals; rows leave at different steps (different max_tokens)."""
    ids, finals, step = {}, {}, 0
    while len(finals) < len(PROMPTS):
        for i, at in enumerate(ARRIVAL_STEP):
            if at == step:
                ids[engine.add_request(PROMPTS[i], params[i])] = i
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out.token_ids
        step += 1
    return [finals[i] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def reference(params) -> list[list[int]]:
    return run(LocalEngine(config(0)), params)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_processors_deriving_state_in_update_state_are_exact_under_spec(reference, params, k):
    engine = LocalEngine(config(k, workers=2))
    assert run(engine, params) == reference
    assert engine.coordinator.metrics.spec_accepted > 0


def _sampler(processor, rows: list[dict]) -> Sampler:
    """A sampler with one custom processor and greedy rows with these extra_args, empty outputs."""
    sampler = Sampler(engine_config(len(rows)), "cpu", custom_logitsprocs=[processor])
    batch = PersistentBatch(len(rows))
    entries = [BatchEntry(f"r{i}", SamplingParams(temperature=0.0, extra_args=extra), [1, 2], [])
               for i, extra in enumerate(rows)]
    batch.update([], entries)
    sampler.update_state(batch.take_update())
    return sampler


def _logits(*tops: dict[int, float]) -> torch.Tensor:
    out = torch.zeros(len(tops), VOCAB)
    for i, top in enumerate(tops):
        for tok, value in top.items():
            out[i, tok] = value
    return out


def _without_contract(monkeypatch) -> None:
    monkeypatch.setattr(Sampler, "drafts_appended", lambda self: None)
    monkeypatch.setattr(Sampler, "draft_snapshot", lambda self: [])
    monkeypatch.setattr(Sampler, "draft_restore", lambda self, snapshots: None)


@pytest.mark.parametrize("contract", [True, False])
def test_decision_made_in_update_state_sees_each_draft(monkeypatch, contract):
    """Token 5 is gated until 2 outputs: at the bonus position (after 2 accepted drafts) it is allowed."""
    if not contract:
        _without_contract(monkeypatch)
    sampler = _sampler(LengthGateProcessor, [{"gate": [5, 2]}])
    logits = _logits({5: 10, 1: 9}, {5: 10, 2: 9}, {5: 10, 3: 9})  # positions 0, 1, bonus
    tokens = verify_drafts(sampler, logits, slice(0, 1), [[1, 2]]).tokens[0]
    assert tokens == ([1, 2, 5] if contract else [1, 2, 3])


@pytest.mark.parametrize("contract", [True, False])
def test_entries_deleted_while_drafts_were_visible_come_back(monkeypatch, contract):
    """vLLM's MinTokens deletes row 1's entry when its three drafts are appended (row 0 keeps the
    loop going); the second draft is rejected, so the row has 2 < 3 tokens and 5 must stay masked.
    Without the restore (update_state(None) alone) the entry stays deleted."""
    if not contract:
        monkeypatch.setattr(Sampler, "draft_snapshot", lambda self: [])
    sampler = _sampler(VllmMinTokensCopy, [{}, {"vmin": [3, 5]}])
    row0 = [{1: 9}] * 4
    row1 = [{5: 10, 1: 9}, {5: 10, 4: 9}, {5: 10, 3: 9}, {5: 10, 3: 9}]
    logits = torch.cat([_logits(*row0), _logits(*row1)])
    result = verify_drafts(sampler, logits, slice(0, 2), [[1, 1, 1], [1, 2, 3]])
    assert result.tokens == [[1, 1, 1, 1], [1, 4]]
    for row, tokens in enumerate(result.tokens):  # the next step: accepted tokens join the lists
        sampler.rows["output"][row].extend(tokens)
    sampler.update_state(None)
    _, chosen, _ = sampler.process(_logits({1: 9}, {5: 10, 3: 9}), slice(0, 2))
    assert int(chosen[1]) == (3 if contract else 5)


@pytest.mark.parametrize(("name", "message"), [
    ("spec_processors:CallCounter", "declares incremental_state"),
    ("spec_processors:HoldsALock", "cannot be copied"),
])
def test_processors_that_cannot_stay_exact_are_refused_with_spec(name, message):
    LocalEngine({**config(0), "processors": [name]})  # fine without speculative decoding
    with pytest.raises(ValueError, match=message):
        LocalEngine({**config(3), "processors": [name]})


def test_a_processor_declaring_spec_support_is_accepted():
    engine = LocalEngine({**config(3), "processors": ["spec_processors:SpecAwareCallCounter"]})
    assert engine.generate("a b a b a b", SamplingParams(temperature=0.0, max_tokens=8))[0].finished

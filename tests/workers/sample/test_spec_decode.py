"""Speculative decoding: exactness for greedy, distribution for random, processors unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import chisquare_pvalue, engine_config, reference_temperature
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.local_engine import LocalEngine
from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from coordinator.spec.ngram_drafter import NgramDrafter
from processors import SamplingParams
from workers.sample.rejection import verify_drafts
from workers.sample.sampler import Sampler

BASE = {"model": {"tiny": "loopy", "max_model_len": 256}, "scheduler": {"max_num_seqs": 6}}
PROMPTS = [
    "a b c d a b c d a b c d a b c d",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello there",
    "1 2 3 1 2 3 1 2 3 1 2",
    "café café café",
]


def mixed_params() -> list[SamplingParams]:
    """Every row greedy; penalties, bad words, logit bias, min tokens and a custom processor on some."""
    g = dict(temperature=0.0, max_tokens=48, ignore_eos=True)
    return [
        SamplingParams(**g, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(**g, bad_words=["fox", " lazy"], presence_penalty=0.5),
        SamplingParams(**g, logit_bias={7: 3.0, 11: -5.0}),
        SamplingParams(**{**g, "ignore_eos": False}, min_tokens=20, logit_bias={2: 4.0}),
        SamplingParams(**g, extra_args={"target_token": 42}),
    ]


@pytest.fixture(scope="module")
def reference_outputs():
    engine = LocalEngine({**BASE, "processors": ["processors.examples:DummyLogitsProcessor"]})
    return [o.token_ids for o in engine.generate(PROMPTS, mixed_params())]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_spec_equals_without(reference_outputs, k):
    engine = LocalEngine(
        {**BASE, "processors": ["processors.examples:DummyLogitsProcessor"], "speculative": {"num_speculative_tokens": k, "draft_policy": "fixed"},
         "cluster": {"num_workers": 2}, "scheduler": {"max_num_seqs": 6, "consistency_check_every": 1}}
    )
    outputs = engine.generate(PROMPTS, mixed_params())
    assert [o.token_ids for o in outputs] == reference_outputs
    assert engine.coordinator.metrics.spec_accepted > 0  # drafts were really verified and taken
    assert outputs[3].token_ids.index(2) >= 20 if 2 in outputs[3].token_ids else True


@pytest.mark.parametrize("k", [1, 4])
def test_random_sampling_with_spec_equals_without(k):
    """Coupled verification: each position's token is the one sampled without speculation."""
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=40, ignore_eos=True, repetition_penalty=r)
              for t, p, s, r in [(0.2, 1.0, 1, 1.0), (0.3, 0.9, None, 1.0), (0.1, 0.95, 7, 1.0),
                                 (0.25, 1.0, None, 1.0), (0.9, 0.8, 3, 1.1)]]
    plain = LocalEngine(BASE).generate(PROMPTS, params)
    spec = LocalEngine({**BASE, "speculative": {"num_speculative_tokens": k, "draft_policy": "fixed"}, "cluster": {"num_workers": 2}})
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == [o.token_ids for o in plain]
    assert spec.coordinator.metrics.spec_accepted > 0


def test_acceptance_above_half_on_repetitive_prompts():
    engine = LocalEngine({**BASE, "speculative": {"num_speculative_tokens": 3, "draft_policy": "fixed"}})
    engine.generate(
        ["a b c a b c a b c a b c a b c", "x y x y x y x y x y", "1 2 3 4 1 2 3 4 1 2 3 4"],
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
    )
    metrics = engine.coordinator.metrics
    assert metrics.spec_proposed > 50
    assert metrics.spec_acceptance > 0.5


def test_stop_conditions_apply_to_accepted_tokens_in_order():
    engine = LocalEngine({**BASE, "speculative": {"num_speculative_tokens": 5, "draft_policy": "fixed"}})
    plain = LocalEngine(BASE)
    params = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True)
    spec_out, = engine.generate([PROMPTS[0]], params)
    ref_out, = plain.generate([PROMPTS[0]], params)
    assert spec_out.token_ids == ref_out.token_ids and len(spec_out.token_ids) == 37
    stop_tok = ref_out.token_ids[10]
    stop = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop_token_ids=[stop_tok])
    spec_stop, = engine.generate([PROMPTS[0]], stop)
    assert spec_stop.token_ids == ref_out.token_ids[: ref_out.token_ids.index(stop_tok) + 1]


def test_ngram_drafter_proposals():
    d = NgramDrafter(3, 1, 3)
    assert d.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert d.propose([5, 6, 7]) == []
    assert d.propose([1, 2, 1, 2, 1, 2], limit=2) == [1, 2]
    assert d.propose([1, 2, 3, 9, 2, 3]) == [9, 2, 3]  # falls back to a shorter tail
    assert d.propose([256, 0, 1]) == []  # 1's bytes occur inside 256, 0, off a token boundary


def _brute_force_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for start in range(total - n - 1, -1, -1):  # latest earlier occurrence, ending before the last token
            if tokens[start : start + n] == tokens[total - n :]:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.sampled_from([0, 1, 7, 256, 65536, 2**32, 2**40]), max_size=40),
       k=st.integers(1, 5), min_n=st.integers(1, 3), extra=st.integers(0, 2))
def test_ngram_drafter_matches_a_brute_force_search(tokens, k, min_n, extra):
    """Byte-level search never takes a match that straddles two ids (values chosen so that they do)."""
    drafter = NgramDrafter(k, min_n, min_n + extra)
    expected = _brute_force_proposal(tokens, k, min_n, min_n + extra) if len(tokens) >= min_n + 1 else []
    assert drafter.propose(tokens) == expected


def _spec_sampler(n: int, params: SamplingParams, drafts: list[int], vocab: int):
    sampler = Sampler(engine_config(n), "cpu")
    batch = PersistentBatch(n)
    entries = []
    for i in range(n):
        p = params.clone()
        p.assign_request_key(f"r{i}", engine_seed=3)
        entries.append(BatchEntry(f"r{i}", p, [1, 2], []))
    batch.update([], entries)
    sampler.update_state(batch.take_update())
    return sampler, [list(drafts) for _ in range(n)]


def test_random_spec_matches_non_spec_distribution_per_position():
    """Drafts [d1, d2]: first token ~ p0; given it is d1, the second ~ p1 (chi-square)."""
    vocab, n = 6, 6000
    position_logits = torch.tensor(
        [[1.5, 0.2, -0.5, 1.0, 0.0, -1.0], [0.0, 1.2, 0.3, -0.7, 0.9, 0.1], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]]
    )
    params = SamplingParams(temperature=0.8)
    d1, d2 = 3, 1
    sampler, drafts = _spec_sampler(n, params, [d1, d2], vocab)
    logits = position_logits.repeat(n, 1)  # each row: 3 positions
    result = verify_drafts(sampler, logits, slice(0, n), drafts)
    first = np.array([t[0] for t in result.tokens])
    probs = [torch.softmax(reference_temperature(row, params).double(), 0).numpy() for row in position_logits]
    assert chisquare_pvalue(np.bincount(first, minlength=vocab), probs[0] * n) > 1e-3
    seconds = np.array([t[1] for t in result.tokens if t[0] == d1])
    assert len(seconds) > 500
    assert chisquare_pvalue(np.bincount(seconds, minlength=vocab), probs[1] * len(seconds)) > 1e-3
    # Accepted drafts and bonus tokens: at most len(drafts) + 1 tokens, drafts first.
    for t in result.tokens:
        assert 1 <= len(t) <= 3
        assert all(a == b for a, b in zip(t[:-1], [d1, d2]))
    assert all(len(o) == 0 for o in sampler.rows["output"][:n])  # drafts were removed again

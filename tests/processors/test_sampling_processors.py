"""The sampler's own stages under random churn equal per-row references, also per shard."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import (
    VOCAB,
    engine_config,
    reference_allowed,
    reference_bad_words,
    reference_penalties,
    reference_temperature,
    reference_top_k_top_p,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from processors import SamplingParams
from processors.builtins.allowed_token_ids import AllowedTokenIdsLogitsProcessor
from processors.builtins.bad_words import BadWordsLogitsProcessor
from processors.builtins.penalties import PenaltiesLogitsProcessor
from processors.builtins.temperature import TemperatureLogitsProcessor
from processors.builtins.top_k_top_p import TopKTopPLogitsProcessor, top_p_threshold
from processors.sampling_params import tokenize_bad_words


class WordTokenizer:
    """Each character is a token; a leading space is its own token 0 ("word start")."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0 if c == " " else (ord(c) % (VOCAB - 1)) + 1 for c in text]


params_strategy = st.builds(
    SamplingParams,
    allowed_token_ids=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
    bad_words=st.one_of(st.none(), st.lists(st.sampled_from(["a", "ab", "bca", "x"]), max_size=3)),
    repetition_penalty=st.sampled_from([1.0, 1.0, 0.8, 1.5]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.5, -0.7]),
    presence_penalty=st.sampled_from([0.0, 0.0, 1.0, -0.3]),
    temperature=st.sampled_from([0.0, 1.0, 0.5, 1.7]),
    top_k=st.sampled_from([0, 0, 1, 3, 10, VOCAB + 5]),
    top_p=st.sampled_from([1.0, 1.0, 0.05, 0.5, 0.9]),
)

STAGES = {
    "allowed": (AllowedTokenIdsLogitsProcessor, lambda row, e: reference_allowed(row, e.params)),
    "bad_words": (BadWordsLogitsProcessor, lambda row, e: reference_bad_words(row, e.params, e.output_token_ids)),
    "penalties": (
        PenaltiesLogitsProcessor,
        lambda row, e: reference_penalties(row, e.params, e.prompt_token_ids, e.output_token_ids),
    ),
    "temperature": (TemperatureLogitsProcessor, lambda row, e: reference_temperature(row, e.params)),
    "top_k_top_p": (TopKTopPLogitsProcessor, lambda row, e: reference_top_k_top_p(row, e.params)),
}


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_stages_match_per_row_reference_under_churn(data):
    capacity = data.draw(st.integers(1, 10))
    config = engine_config(capacity)
    procs = {name: cls(config, torch.device("cpu"), False) for name, (cls, _) in STAGES.items()}
    batch = PersistentBatch(capacity)
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    tokenizer = WordTokenizer()
    counter = 0
    for _ in range(data.draw(st.integers(1, 15))):
        live = batch.request_ids()
        finished = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        arrivals = []
        for _ in range(data.draw(st.integers(0, capacity - len(live) + len(finished)))):
            params = data.draw(params_strategy)
            params.update_from_tokenizer(tokenizer)
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
            arrivals.append(BatchEntry(f"r{counter}", params, prompt, []))
            counter += 1
        batch.update(finished, arrivals)
        if batch.num_reqs >= 2 and rng.random() < 0.5:
            batch.swap(rng.randrange(batch.num_reqs), rng.randrange(batch.num_reqs))
        update = batch.take_update()
        for proc in procs.values():
            proc.update_state(update)
        # Few distinct values make ties common: top-k must keep them together.
        logits = torch.randint(-4, 5, (batch.num_reqs, VOCAB), generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).float() / 2
        for name, proc in procs.items():
            reference = STAGES[name][1]
            want = (
                torch.stack([reference(logits[i], e) for i, e in enumerate(batch.entries())])
                if batch.num_reqs
                else logits
            )
            got = proc.apply(logits.clone())
            assert torch.allclose(got, want, atol=1e-6, equal_nan=False) and torch.equal(got.isinf(), want.isinf()), name
            if batch.num_reqs:
                lo = rng.randrange(batch.num_reqs)
                hi = rng.randrange(lo, batch.num_reqs) + 1
                shard = proc.apply_rows(logits[lo:hi].clone(), slice(lo, hi))
                assert torch.equal(shard, got[lo:hi]), f"{name} shard"
        for e in batch.entries():
            e.output_token_ids.append(rng.choice([0, 1, 2, 3, rng.randrange(VOCAB)]))


def test_top_p_widens_candidates_for_flat_rows():
    # A flat row needs far more than the first 64 candidates to reach p = 0.9.
    logits = torch.zeros(2, 5000)
    logits[1, :3] = 10.0  # peaked row: done in the first window
    import numpy as np

    thresholds = top_p_threshold(logits, np.array([0.9, 0.9]))
    flat_kept = int((logits[0] >= thresholds[0]).sum())
    assert flat_kept == 5000  # all tied: the nucleus keeps the whole tie
    assert int((logits[1] >= thresholds[1]).sum()) == 3


def test_top_k_keeps_ties():
    proc = TopKTopPLogitsProcessor(engine_config(2), torch.device("cpu"), False)
    batch = PersistentBatch(2)
    batch.update([], [BatchEntry("a", SamplingParams(top_k=2), [1], [])])
    proc.update_state(batch.take_update())
    out = proc.apply(torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.0]]))
    assert torch.isfinite(out[0]).tolist() == [True, False, True, True, False]


def test_tokenize_bad_words_with_and_without_leading_space():
    tok = WordTokenizer()
    assert tokenize_bad_words(["ab"], tok) == [tok.encode("ab")]  # " ab" is longer: not a second form

    class SpaceMerging:
        def encode(self, text, add_special_tokens=False):
            return {"ab": [5, 6], " ab": [7, 6]}[text]

    assert tokenize_bad_words(["ab"], SpaceMerging()) == [[5, 6], [7, 6]]
    with pytest.raises(ValueError, match="tokenizes to no token"):

        class Empty:
            def encode(self, text, add_special_tokens=False):
                return []

        tokenize_bad_words(["zz"], Empty())


def test_bad_words_must_be_tokenized_first():
    proc = BadWordsLogitsProcessor(engine_config(2), torch.device("cpu"), False)
    batch = PersistentBatch(2)
    batch.update([], [BatchEntry("a", SamplingParams(bad_words=["x"]), [1], [])])
    with pytest.raises(ValueError, match="not tokenized"):
        proc.update_state(batch.take_update())


def test_top_p_alone_on_every_row_matches_the_reference_and_the_mixed_batch():
    """Every row top-p only takes a shorter path (its first window reused, no masked copy): the same
    result as the reference, and as the same rows beside a top-k row (the general path)."""
    vocab = 5000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 2
    logits[0] = 0.0  # flat: the nucleus widens past the first window
    logits[1, 7] = 30.0  # peaked
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5), SamplingParams(top_p=0.95)]

    def filtered(all_params):
        proc = TopKTopPLogitsProcessor(engine_config(len(all_params)), torch.device("cpu"), False)
        batch = PersistentBatch(len(all_params))
        batch.update([], [BatchEntry(f"r{i}", p, [1], []) for i, p in enumerate(all_params)])
        proc.update_state(batch.take_update())
        rows = torch.cat([logits, torch.randn(len(all_params) - 3, vocab)]) if len(all_params) > 3 else logits
        return proc.apply(rows.clone())[:3]

    alone = filtered(params)
    beside_top_k = filtered(params + [SamplingParams(top_k=5)])
    assert torch.equal(alone, beside_top_k)
    for row, p, got in zip(logits, params, alone):
        want = reference_top_k_top_p(row, p)
        assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got, want)
    assert int(torch.isfinite(alone[0]).sum()) == vocab and int(torch.isfinite(alone[1]).sum()) == 1

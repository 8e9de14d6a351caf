"""The composed sampler: pipeline order, placement-independent randomness, logprobs, errors."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from helpers import (
    chisquare_pvalue,
    engine_config,
    reference_logit_bias,
    reference_min_p,
    reference_penalties,
    reference_temperature,
    reference_top_k_top_p,
)

from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from processors import LogitsProcessor, SamplingParams
from processors.examples import DummyLogitsProcessor
from workers.sample.sampler import LogitsProcessorError, Sampler

VOCAB = 64


def model_logits(request_ids: list[str], step: int, vocab: int = VOCAB) -> torch.Tensor:
    """Stand-in for a model: each request's logits depend only on the request and step."""
    rows = []
    for rid in request_ids:
        g = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{step}".encode()))
        rows.append(torch.randn(vocab, generator=g) * 2)
    return torch.stack(rows)


def make(sampler_capacity: int = 64, custom=()) -> tuple[Sampler, PersistentBatch]:
    return Sampler(engine_config(sampler_capacity), "cpu", custom), PersistentBatch(sampler_capacity)


def generate(sampler: Sampler, batch: PersistentBatch, entries: list[BatchEntry], steps: int, swap_every: int = 0,
             shards: int = 1) -> dict[str, list[int]]:
    """Run `steps` sampling steps over entries (all admitted at step 0); return each request's tokens."""
    batch.update([], entries)
    for step in range(steps):
        if swap_every and step % swap_every == 1 and batch.num_reqs > 1:
            batch.swap(0, batch.num_reqs - 1)
        sampler.update_state(batch.take_update())
        ids = batch.request_ids()
        logits = model_logits(ids, step)
        bounds = np.linspace(0, len(ids), shards + 1).astype(int)
        tokens = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                tokens.extend(sampler(logits[lo:hi].clone(), slice(int(lo), int(hi))).sampled_token_ids.tolist())
        for entry, token in zip(batch.entries(), tokens):
            entry.output_token_ids.append(token)
    return {e.request_id: list(e.output_token_ids) for e in batch.entries()}


def feature_params(seed: int | None) -> SamplingParams:
    p = SamplingParams(
        seed=seed, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
        frequency_penalty=0.3, presence_penalty=0.2, logit_bias={3: 1.5}, min_tokens=2, stop_token_ids=[5],
    )
    p.update_from_generation_config({}, eos_token_id=1)
    return p


def others(n: int, prefix: str = "other") -> list[BatchEntry]:
    kinds = [SamplingParams(temperature=0.0), SamplingParams(seed=99, top_k=3), SamplingParams(temperature=1.3, top_p=0.5)]
    out = []
    for i in range(n):
        p = kinds[i % 3].clone()
        p.assign_request_key(f"{prefix}{i}", engine_seed=0)
        out.append(BatchEntry(f"{prefix}{i}", p, [2, 4], []))
    return out


def test_seeded_request_identical_alone_in_crowd_at_other_row_and_sharded():
    target = lambda: BatchEntry("target", feature_params(seed=1234), [7, 8, 9], [])
    alone = generate(*make(), [target()], steps=12)["target"]
    crowd = generate(*make(), [*others(40), target(), *others(23, "late")[::-1]], steps=12)["target"]
    moved = generate(*make(), [*others(5), target()], steps=12, swap_every=3)["target"]
    sharded = generate(*make(), [*others(30), target(), *others(10, "late")], steps=12, shards=4)["target"]
    assert alone == crowd == moved == sharded
    assert len(set(alone)) > 3  # it is really random, not constant


def test_different_seeds_give_different_streams_and_unseeded_keys_differ_by_request():
    a = generate(*make(), [BatchEntry("a", feature_params(seed=1), [7], [])], steps=20)["a"]
    b = generate(*make(), [BatchEntry("a", feature_params(seed=2), [7], [])], steps=20)["a"]
    assert a != b
    p1, p2 = SamplingParams(), SamplingParams()
    p1.assign_request_key("req-1", engine_seed=0)
    p2.assign_request_key("req-2", engine_seed=0)
    assert p1.sampling_key != p2.sampling_key
    p3 = SamplingParams()
    p3.assign_request_key("req-1", engine_seed=0)
    assert p3.sampling_key == p1.sampling_key


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.2, min_p=0.2),
        SamplingParams(temperature=0.9, repetition_penalty=1.5, logit_bias={7: 1.0}),
    ],
    ids=["top_k", "top_p", "min_p", "penalty_bias"],
)
def test_empirical_distribution_matches_processed_probabilities(params):
    """Chi-square over many keys: the sampled token follows softmax of the processed logits."""
    vocab, n = 8, 4000
    prompt = [0, 6]
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    sampler, batch = make(n)
    entries = []
    for i in range(n):
        p = params.clone()
        p.assign_request_key(f"r{i}", engine_seed=7)
        entries.append(BatchEntry(f"r{i}", p, prompt, []))
    batch.update([], entries)
    sampler.update_state(batch.take_update())
    tokens = sampler(logits.repeat(n, 1)).sampled_token_ids.numpy()
    processed = reference_logit_bias(logits, params)
    processed = reference_penalties(processed, params, prompt, [])
    processed = reference_temperature(processed, params)
    processed = reference_min_p(processed, params)
    processed = reference_top_k_top_p(processed, params)
    probs = torch.softmax(processed.double(), dim=0).numpy()
    observed = np.bincount(tokens, minlength=vocab)
    assert observed[probs == 0].sum() == 0
    nz = probs > 0
    expected = probs[nz] / probs[nz].sum() * n
    assert chisquare_pvalue(observed[nz], expected) > 1e-3


def test_greedy_rows_take_argmax_after_non_invariant_stages_only():
    sampler, batch = make(4)
    p = SamplingParams(temperature=0.0, logit_bias={10: 50.0})
    batch.update([], [BatchEntry("g", p, [1], [])])
    sampler.update_state(batch.take_update())
    assert sampler(torch.zeros(1, VOCAB)).sampled_token_ids.tolist() == [10]


class CountingInvariant(LogitsProcessor):
    """Argmax-invariant and stateless about rows; counts its calls."""

    calls = 0

    def __init__(self, config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        CountingInvariant.calls += 1
        return logits


def test_argmax_invariant_stages_skipped_when_whole_batch_greedy():
    sampler, batch = make(4, custom=[CountingInvariant])
    batch.update([], [BatchEntry("g", SamplingParams(temperature=0.0), [1], [])])
    sampler.update_state(batch.take_update())
    CountingInvariant.calls = 0
    sampler(torch.randn(1, VOCAB))
    assert CountingInvariant.calls == 0
    batch.update([], [BatchEntry("r", SamplingParams(seed=1), [1], [])])
    sampler.update_state(batch.take_update())
    sampler(torch.randn(2, VOCAB))
    assert CountingInvariant.calls == 1


class RowMarker(LogitsProcessor):
    """No apply_rows: writes a marker into every row it is given (a crude per-row processor)."""

    def __init__(self, config, device, is_pin_memory):
        self.rows: dict[int, int] = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        from processors import process_dict_updates
        process_dict_updates(self.rows, batch_update, lambda p, _, __: (p.extra_args or {}).get("mark"))

    def apply(self, logits):
        for row, token in self.rows.items():
            logits[row, token] += 100.0
        return logits


def test_custom_processor_without_apply_rows_changes_only_its_shard_rows():
    sampler, batch = make(8, custom=[RowMarker])
    entries = [
        BatchEntry(f"r{i}", SamplingParams(temperature=0.0, extra_args={"mark": 10 + i}), [1], []) for i in range(6)
    ]
    batch.update([], entries)
    sampler.update_state(batch.take_update())
    logits = torch.zeros(6, VOCAB)
    out = sampler(logits[2:5].clone(), slice(2, 5))
    assert out.sampled_token_ids.tolist() == [12, 13, 14]


def test_seed_processor_in_shard_and_full_batch_agree():
    sampler, batch = make(8, custom=[DummyLogitsProcessor])
    entries = [
        BatchEntry(f"r{i}", SamplingParams(seed=i, extra_args={"target_token": 20 + i} if i % 2 else None), [1], [])
        for i in range(6)
    ]
    batch.update([], entries)
    sampler.update_state(batch.take_update())
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    full = sampler(logits.clone()).sampled_token_ids
    shard = torch.cat([sampler(logits[a:b].clone(), slice(a, b)).sampled_token_ids for a, b in ((0, 2), (2, 6))])
    assert torch.equal(full, shard)
    assert full[1].item() == 21 and full[3].item() == 23 and full[5].item() == 25


class Exploding(LogitsProcessor):
    def __init__(self, config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        raise ZeroDivisionError("boom")


def test_processor_raising_is_named():
    sampler, batch = make(4, custom=[Exploding])
    batch.update([], [BatchEntry("a", SamplingParams(), [1], [])])
    sampler.update_state(batch.take_update())
    with pytest.raises(LogitsProcessorError, match=r"test_sampler\.Exploding raised in apply: ZeroDivisionError: boom"):
        sampler(torch.randn(1, VOCAB))


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(logit_bias={VOCAB: 1.0}), r"logit_bias has token id\(s\) \[64\] outside the vocabulary \[0, 64\)"),
        (SamplingParams(allowed_token_ids=[1, 99]), r"allowed_token_ids has token id\(s\) \[99\]"),
        (SamplingParams(stop_token_ids=[70]), r"stop_token_ids has token id\(s\) \[70\]"),
    ],
)
def test_validate_rejects_out_of_vocab_ids(params, message):
    with pytest.raises(ValueError, match=message):
        Sampler.validate(params, VOCAB)
    Sampler.validate(SamplingParams(logit_bias={VOCAB - 1: 1.0}), VOCAB)


def test_validate_checks_tokenized_bad_words():
    p = SamplingParams(bad_words=["zz"])

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [VOCAB + 3]

    p.update_from_tokenizer(Tok())
    with pytest.raises(ValueError, match=r"bad_words has token id\(s\) \[67\]"):
        Sampler.validate(p, VOCAB)


def test_logprobs_come_from_raw_logits():
    sampler, batch = make(4)
    batch.update([], [
        BatchEntry("a", SamplingParams(temperature=0.0, logprobs=3, logit_bias={0: 100.0}), [1], []),
        BatchEntry("b", SamplingParams(temperature=0.0), [1], []),
    ])
    sampler.update_state(batch.take_update())
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    out = sampler(logits.clone())
    assert set(out.logprobs) == {0}
    lp = out.logprobs[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert lp.sampled_token_id == 0  # forced by the bias...
    assert lp.sampled_logprob == pytest.approx(raw[0].item())  # ...but its logprob is the raw one
    assert lp.sampled_rank == int((raw >= raw[0]).sum())
    assert lp.top_token_ids == raw.topk(3).indices.tolist()
    assert lp.top_logprobs == pytest.approx(raw.topk(3).values.tolist())

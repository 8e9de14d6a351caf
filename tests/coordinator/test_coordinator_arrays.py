"""The coordinator's array step loop: equal to its per-row reference, and exact at 8 fake workers.

The coordinator accepts tokens and applies stop conditions with array operations (issue 25);
``no_fast_paths`` (here) sends every row through the per-request code instead. Both, fed the same
random results, must produce the same plans and the same outputs. Then 8 real workers (mirror,
processor replicas, sampler) with a fake model must agree on every digest every step.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from cluster.config import load_config, resolve
from cluster.engine.audit import check_consistency
from coordinator.coordinator import Coordinator
from coordinator.coordinator_config import CoordinatorConfig, KVSettings, ModelInfo
from cluster.engine.setup import coordinator_from_config
from coordinator.spec.ngram_drafter import NgramDrafter
from processors import SamplingParams
from fake_runner import RandomLogitsRunner
from workers.model.tiny import ensure_tiny_model
from workers.sample.sampler import Sampler
from workers.step.worker import Worker
from workers.wire import StepResult, TokenLogprobs

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny_model("default"))


def no_fast_paths(simple: np.ndarray, multi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every row through the per-request code, as before the array paths existed: the reference."""
    return np.zeros_like(simple), np.zeros_like(multi)


def coordinator(tokenizer, spec: bool, reference: bool) -> Coordinator:
    model = ModelInfo(vocab_size=VOCAB, max_model_len=64, eos_token_id=tokenizer.eos_token_id, generation_config={})
    config = CoordinatorConfig(max_num_seqs=8, num_workers=2, rows_per_worker=4,
                               kv=KVSettings(num_blocks=40, block_size=4, max_num_batched_tokens=64))
    coord = Coordinator(tokenizer, model, config, drafter=NgramDrafter(3, 1, 2) if spec else None)
    if reference:
        coord.acceptance.fast_paths = no_fast_paths  # this instance only
    return coord


request_specs = st.lists(
    st.fixed_dictionaries({
        "prompt_len": st.integers(1, 20),
        "max_tokens": st.integers(1, 24),
        "min_tokens": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.sampled_from([[], [40], [41, 42]]),
        "stop": st.sampled_from([None, ["e"], ["th", " a"], ["é"], ["你好", "🙂"], ["a b", "\ufffd"]]),
        "include_stop": st.booleans(),
        "logprobs": st.sampled_from([None, 1]),
        "n": st.sampled_from([1, 1, 2]),
        "final_only": st.booleans(),
    }),
    min_size=1, max_size=14,
)


def fake_results(c: Coordinator, plan, rng: random.Random) -> list[StepResult]:
    """Tokens a worker could return: EOS and stop ids often, drafts accepted up to a random point."""
    table = c.scheduler.table
    results = []
    eos = c.model.eos_token_id
    for w, (lo, hi) in enumerate(plan.shards.tolist()):
        tokens, counts, logprobs = [], [], {}
        for r in range(lo, hi):
            drafts = plan.drafts_of(r)
            pick = rng.choice([eos, 40, 41, 42, rng.randrange(60, 90), rng.randrange(3, VOCAB), rng.randrange(3, 262)])
            row = drafts[: rng.randint(0, len(drafts))] + [pick]  # 3..261: many bytes of multi-byte characters
            tokens += row
            counts.append(len(row))
            if table.requests[int(c._plan_slots[r])].params.logprobs is not None:
                logprobs[r] = [TokenLogprobs([t], [-0.5], t, -0.5, 1) for t in row]
        results.append(StepResult(w, plan.step, (lo, hi), np.array(tokens, np.int32),
                                  np.array(counts, np.int32), logprobs))
    return results


def counts_of(plan) -> np.ndarray:
    """Tokens per row of the last step (``None`` means one each, or none at all)."""
    if plan.last_counts is not None:
        return plan.last_counts
    return np.ones(len(plan.last_tokens), np.int32)


def snapshot(out) -> tuple:
    return (out.request_id, out.finished, out.error, tuple(
        (c.index, tuple(c.token_ids), c.text, str(c.finish_reason), c.stop_reason,
         None if c.logprobs is None else len(c.logprobs), c.new_text, tuple(c.new_token_ids))
        for c in out.outputs))


def test_byte_table_decodes_as_the_tokenizer(tokenizer):
    """The stop-string byte scan relies on it (checked again at start-up; None would fall back)."""
    from coordinator.output.stop_bytes import token_bytes

    table = token_bytes(tokenizer)
    assert table is not None and len(table) == len(tokenizer)
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(table)) for _ in range(rng.randint(1, 20))]
        assert b"".join(table[i] for i in ids).decode("utf-8", errors="replace") == tokenizer.decode(
            ids, skip_special_tokens=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=request_specs, seed=st.integers(0, 2**16), spec=st.booleans())
def test_array_accept_equals_per_row_reference(tokenizer, specs, seed, spec):
    fast, reference = coordinator(tokenizer, spec, False), coordinator(tokenizer, spec, True)
    prompt_rng = random.Random(seed)
    for i, s in enumerate(specs):
        prompt = [prompt_rng.randrange(60, 90) for _ in range(s["prompt_len"])]
        params = SamplingParams(max_tokens=s["max_tokens"], min_tokens=min(s["min_tokens"], s["max_tokens"]),
                                ignore_eos=s["ignore_eos"], stop_token_ids=s["stop_token_ids"], stop=s["stop"],
                                include_stop_str_in_output=s["include_stop"],
                                logprobs=s["logprobs"], n=s["n"], temperature=0.0 if s["n"] == 1 else 0.8, seed=i)
        for c in (fast, reference):
            c.add_request(prompt, params.clone(), request_id=f"r{i}", final_only=s["final_only"])
    rng_fast, rng_ref = random.Random(seed), random.Random(seed)
    for _ in range(200):
        plan, plan_ref = fast.next_plan(), reference.next_plan()
        assert (plan is None) == (plan_ref is None)
        if plan is None:
            break
        np.testing.assert_array_equal(plan.last_tokens, plan_ref.last_tokens)
        np.testing.assert_array_equal(counts_of(plan), counts_of(plan_ref))
        np.testing.assert_array_equal(plan.start, plan_ref.start)
        np.testing.assert_array_equal(plan.num_tokens, plan_ref.num_tokens)
        fast.accept_step(plan, fake_results(fast, plan, rng_fast))
        reference.accept_step(plan_ref, fake_results(reference, plan_ref, rng_ref))
        assert sorted(map(snapshot, fast.take_outputs())) == sorted(map(snapshot, reference.take_outputs()))
        assert fast.metrics.generated_tokens == reference.metrics.generated_tokens
        assert fast.metrics.spec_accepted == reference.metrics.spec_accepted
    assert not fast.has_unfinished() and not reference.has_unfinished()


def test_eight_fake_workers_agree_every_step_and_every_request_finishes_once():
    """2,000 mixed requests over 8 workers with real replicas (mirror, processors, sampler) and a
    fake model; the digest audit runs every step and some requests are aborted mid-way."""
    cfg = load_config({
        "model": {"tiny": "default", "max_model_len": 96},
        "cluster": {"num_workers": 8},
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 4096, "consistency_check_every": 1},
    })
    coord = coordinator_from_config(resolve(cfg), num_blocks=160, block_size=8)
    engine_config = cfg.engine_config(None, VOCAB, 96)
    workers = [Worker(i, RandomLogitsRunner(VOCAB, seed=i), Sampler(engine_config, "cpu", cfg.custom_processors()))
               for i in range(8)]
    rng = random.Random(8)
    kinds = [
        lambda i: SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 16)),
        lambda i: SamplingParams(temperature=0.9, seed=i, top_k=20, max_tokens=rng.randint(1, 16)),
        lambda i: SamplingParams(temperature=1.0, max_tokens=rng.randint(2, 16), min_tokens=2,
                                 repetition_penalty=1.2, logit_bias={7: 3.0}),
        lambda i: SamplingParams(temperature=0.7, seed=i, n=2, max_tokens=rng.randint(1, 12), logprobs=2),
        lambda i: SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 16), stop=["e", "a "],
                                 bad_words=["the"]),
        lambda i: SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 16), stop_token_ids=[65, 66]),
    ]
    ids = [coord.add_request([rng.randrange(10, VOCAB) for _ in range(rng.randint(1, 40))], kinds[i % 6](i),
                             request_id=f"q{i}", final_only=bool(i % 2)) for i in range(2000)]
    finals: Counter[str] = Counter()
    aborted = set()
    steps = 0
    while coord.has_unfinished():
        plan = coord.next_plan()
        if plan is None:
            continue
        results = [w.step(plan) for w in workers]
        assert plan.audit
        check_consistency(plan.step, results)  # every worker's mirror and processors agree
        coord.accept_step(plan, results)
        for out in coord.take_outputs():
            if out.finished:
                finals[out.request_id] += 1
        steps += 1
        if steps % 7 == 0:  # abort a running request now and then
            running = [e.request_id for e in coord.batch.entries()]
            if running:
                rid = running[len(running) // 2].split("#")[0]
                if coord.abort(rid):
                    aborted.add(rid)
        assert steps < 3000
    finals.update(o.request_id for o in coord.take_outputs() if o.finished)
    assert set(finals) == set(ids)
    assert max(finals.values()) == 1
    assert aborted and steps > 50

"""vLLM's Model Runner V2 (slot-keyed) processors load from configs and run in the same sampler:
sharded, audited, validated at admission, and exact under speculative decoding."""

from __future__ import annotations

import pytest
import torch
from mrv2_processors import Recorder

from cluster.engine.local_engine import LocalEngine
from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from processors import EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from workers.sample.sampler import Sampler

PROMPTS = ["a b c d a b c d a b c d", "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "1 2 3 1 2 3 1 2 3 1 2", "x y x y x y x y", "café café café", "Hello there Hello there"]


def config(processors, spec: int = 0, workers: int = 1) -> dict:
    base = {"model": {"tiny": "loopy", "max_model_len": 256},
            "scheduler": {"max_num_seqs": 4, "consistency_check_every": 1},
            "cluster": {"num_workers": workers}, "processors": processors}
    if spec:
        base["speculative"] = {"num_speculative_tokens": spec, "draft_policy": "fixed"}
    return base


def test_slot_keyed_processor_by_name_sharded_and_validated():
    engine = LocalEngine(config(["mrv2_processors:TargetTokenV2", "mrv2_processors:NeverEnabled"], workers=2))
    params = [SamplingParams(max_tokens=6, extra_args={"target_token": 40 + i}) if i % 2 else
              SamplingParams(temperature=0.0, max_tokens=6) for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    plain = LocalEngine(config([])).generate(PROMPTS, params)
    for i, (out, ref) in enumerate(zip(outs, plain)):
        assert out.token_ids == ([40 + i] * 6 if i % 2 else ref.token_ids)
    bad = engine.generate("x", SamplingParams(max_tokens=2, extra_args={"target_token": "x"}))[0]
    assert bad.error and "target_token must be a non-negative integer" in bad.error


def test_slot_keyed_processor_given_as_a_class():
    from mrv2_processors import TargetTokenV2

    out = LocalEngine(config([TargetTokenV2])).generate("a", SamplingParams(max_tokens=3, extra_args={"target_token": 7}))
    assert out[0].token_ids == [7, 7, 7]


@pytest.fixture(scope="module")
def spec_params() -> list[SamplingParams]:
    """Rules built from each prompt's own greedy output, so they bite: its most common token is
    banned for a while, or its most common bigram is a bad word."""
    from collections import Counter

    free = LocalEngine(config([])).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        ids = out.token_ids
        if i % 2:
            rule = {"ban_until": [Counter(ids).most_common(1)[0][0], 6 + 2 * i]}
        else:
            rule = {"bad_token_words": [list(Counter(zip(ids, ids[1:])).most_common(1)[0][0])]}
        params.append(SamplingParams(temperature=0.0, max_tokens=30 + i, ignore_eos=True, extra_args=rule))
    return params


@pytest.mark.parametrize("k", [1, 2, 4])
def test_exact_under_spec_with_drafts_only_in_input_ids(spec_params, k):
    processors = ["mrv2_processors:BanUntilV2", "mrv2_processors:BadWordsV2"]
    reference = [o.token_ids for o in LocalEngine(config(processors)).generate(PROMPTS, spec_params)]
    unconstrained = [o.token_ids for o in LocalEngine(config([])).generate(PROMPTS, spec_params)]
    assert sum(a != b for a, b in zip(reference, unconstrained)) >= 3  # the processors bite
    engine = LocalEngine(config(processors, spec=k, workers=2))
    assert [o.token_ids for o in engine.generate(PROMPTS, spec_params)] == reference
    assert engine.coordinator.metrics.spec_accepted > 0


def test_context_at_draft_positions():
    """Committed tokens in all_token_ids; at draft position 2 the request's rows 0..2 carry
    the last committed token and drafts 1, 2 as input ids."""
    cfg = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=2), model_config=ModelConfig(64, 32, None))
    sampler = Sampler(cfg, "cpu", [Recorder])
    batch = PersistentBatch(2)
    output = [9, 8]
    batch.update([], [BatchEntry("a", SamplingParams(temperature=0.0), [1, 2, 3], output)])
    sampler.update_state(batch.take_update())
    state = sampler.slot_processors.req_states
    assert state.all_token_ids.np[0, :5].tolist() == [1, 2, 3, 9, 8] and state.total_len.np[0] == 5
    output.extend([20, 21])  # two drafts appended, not committed
    Recorder.contexts.clear()
    sampler.process(torch.zeros(1, 64), slice(0, 1), {0: 2})
    (ctx,) = Recorder.contexts
    assert ctx.expanded_local_pos.tolist() == [0, 1, 2] and ctx.input_ids.tolist() == [8, 20, 21]
    assert ctx.pos.tolist() == [4, 5, 6] and ctx.expanded_idx_mapping.tolist() == [0, 0, 0]
    assert state.total_len.np[0] == 5  # drafts never reach the committed state

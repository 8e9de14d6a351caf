"""Paged KV: block accounting, prefix caching, chunked prefill, preemption and n > 1 on the tiny model."""

from __future__ import annotations

import random

import pytest

from cluster.engine.local_engine import LocalEngine
from coordinator.kv_blocks import BlockPool, chain_keys
from processors import SamplingParams

TINY = {"tiny": "default", "max_model_len": 192}


def engine(**sections) -> LocalEngine:
    config = {"model": TINY, "scheduler": {"max_num_seqs": 6}, "cache": {"block_size": 4}}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return LocalEngine(config)


class PlanLog:
    """Records every plan an engine runs."""

    def __init__(self, eng: LocalEngine) -> None:
        self.plans = []
        original = eng.coordinator.next_plan

        def next_plan():
            plan = original()
            if plan is not None:
                self.plans.append(plan)
            return plan

        eng.coordinator.next_plan = next_plan

    def fed(self) -> int:
        return sum(int(p.num_tokens.sum()) for p in self.plans)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


MIXED = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
         SamplingParams(temperature=0.9, top_k=30, seed=5, max_tokens=25, ignore_eos=True),
         SamplingParams(temperature=1.0, top_p=0.9, max_tokens=18, ignore_eos=True)]


def mixed_params(n: int) -> list[SamplingParams]:
    return [MIXED[i % len(MIXED)] for i in range(n)]


# ----- block pool -----

def test_block_pool_refcounts_and_lru_eviction():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_free == 2
    pool.register(0, b"k0")
    pool.register(1, b"k1")
    pool.share([0])  # a second request hits block 0
    pool.release(a)  # tail first: 1 becomes free before 0 is (0 is still shared)
    assert pool.num_free == 3 and pool.lookup([b"k0", b"k1"]) == [0, 1]
    assert pool.allocate(2) == [2, 3]  # never-used blocks first, cached ones stay
    assert pool.allocate(1) == [1]  # then the least recently freed cached block is evicted
    assert pool.lookup([b"k0", b"k1"]) == [0]
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)


def test_blank_blocks_are_reused_before_any_cached_prefix_is_evicted():
    pool = BlockPool(6)
    first = pool.allocate(2)
    pool.register(first[0], b"k0")  # a full, cached block and a partial tail
    second = pool.allocate(2)
    pool.release(first)  # freed first: cached block 0 and blank block 1
    pool.release(second)  # freed later: two blank blocks
    assert pool.allocate(4) == [1, 2, 3, 4]  # every blank block, lowest first; the cache keeps k0
    assert pool.lookup([b"k0"]) == [0]
    assert pool.allocate(2) == [5, 0] and pool.lookup([b"k0"]) == []


def test_chain_keys_identify_whole_prefixes():
    a = chain_keys(list(range(12)), 4, b"")
    b = chain_keys(list(range(8)) + [99, 99, 99, 99], 4, b"")
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert chain_keys(list(range(12)), 4, b"other")[0] != a[0]
    assert chain_keys(list(range(11)), 4, b"") == a[:2]  # partial blocks have no key


# ----- chunked prefill -----

def test_chunked_prefill_is_exact_and_respects_the_budget():
    prompts = random_prompts(8, 20, 120)
    reference = [o.token_ids for o in engine(scheduler={"max_num_batched_tokens": 4096}).generate(prompts, mixed_params(8))]
    small = engine(scheduler={"max_num_batched_tokens": 10})
    log = PlanLog(small)
    assert [o.token_ids for o in small.generate(prompts, mixed_params(8))] == reference
    for plan in log.plans:
        drafts = int(plan.draft_counts.sum()) if plan.draft_counts is not None else 0
        assert int(plan.num_tokens.sum()) + drafts <= 10
    assert any(((p.num_tokens > 1) & (p.start > 0)).any() for p in log.plans)  # a chunk went on


def test_decoding_rows_are_not_starved_by_a_long_prompt():
    eng = engine(scheduler={"max_num_batched_tokens": 16})
    log = PlanLog(eng)
    short = eng.add_request([11, 12, 13], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.add_request(random_prompts(1, 150, 150)[0], SamplingParams(temperature=0.0, max_tokens=4))
    before = len(eng.coordinator.rows[short].output_token_ids)
    for _ in range(8):  # the long prompt needs ~10 steps of prefill at 15 tokens a step
        eng.step()
    assert len(eng.coordinator.rows[short].output_token_ids) == before + 8
    assert max(int(p.num_tokens.max()) for p in log.plans) <= 15


# ----- prefix caching -----

def test_shared_system_prompt_is_prefilled_once_per_worker():
    system = random_prompts(1, 64, 64, seed=3)[0]
    own = random_prompts(12, 3, 9, seed=4)
    prompts = [system + o for o in own]
    params = mixed_params(12)
    off = engine(cluster={"num_workers": 2}, cache={"enable_prefix_caching": False})
    off_log = PlanLog(off)
    reference = [o.token_ids for o in off.generate(prompts, params)]
    assert off.coordinator.kv.hit_tokens == 0
    on = engine(cluster={"num_workers": 2})
    on_log = PlanLog(on)
    assert [o.token_ids for o in on.generate(prompts, params)] == reference
    prompt_tokens = sum(len(p) for p in prompts)
    assert off_log.fed() - on_log.fed() == prompt_tokens - (2 * len(system) + sum(len(o) for o in own))
    assert on.coordinator.kv.hit_tokens == 10 * len(system)


def test_cached_prefix_survives_its_request_and_is_evicted_when_blocks_run_out():
    eng = engine(cache={"kv_cache_memory": 60 * 2 * 2 * 4 * 2 * 16 * 4})  # 60 blocks of 4 tokens
    system = random_prompts(1, 40, 40, seed=5)[0]
    first = eng.generate(system + [7], SamplingParams(temperature=0.0, max_tokens=5))[0]
    eng.generate(system + [8], SamplingParams(temperature=0.0, max_tokens=5))
    assert eng.coordinator.kv.hit_tokens == 40
    eng.generate(random_prompts(6, 30, 30, seed=6), SamplingParams(temperature=0.0, max_tokens=4))  # fills the pool
    hits = eng.coordinator.kv.hit_tokens
    again = eng.generate(system + [7], SamplingParams(temperature=0.0, max_tokens=5))[0]
    # Tail blocks are evicted first: at most a head of the prefix is still cached, and output is unchanged.
    assert again.token_ids == first.token_ids and eng.coordinator.kv.hit_tokens - hits < 40


# ----- preemption -----

@pytest.mark.parametrize("spec", [False, True])
def test_preemption_recomputes_exactly(spec):
    prompts = random_prompts(10, 20, 60, seed=8)
    params = mixed_params(10)
    extra = {"speculative": {"num_speculative_tokens": 3, "draft_policy": "fixed"}} if spec else {}
    roomy = engine(**extra)
    reference = [o.token_ids for o in roomy.generate(prompts, params)]
    assert roomy.coordinator.scheduler.num_preemptions == 0
    # 48 blocks of 4 tokens per worker: one max_model_len sequence fits, six long ones do not.
    tight = engine(cache={"kv_cache_memory": 48 * 2 * 2 * 4 * 2 * 16 * 4}, **extra)
    assert [o.token_ids for o in tight.generate(prompts, params)] == reference
    assert tight.coordinator.scheduler.num_preemptions > 0


# ----- n > 1 -----

def test_n_completions_share_the_prompt_blocks_and_have_their_own_streams():
    prompt = random_prompts(1, 30, 30, seed=9)[0]
    eng = engine(cache={"enable_prefix_caching": False})
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=12, ignore_eos=True)
    out = eng.generate(prompt, params)[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert eng.coordinator.kv.hit_tokens == 2 * 28  # siblings reuse the 7 full blocks
    single = eng.generate(prompt, SamplingParams(temperature=1.0, seed=21, max_tokens=12, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids
    assert eng.coordinator.kv.hit_tokens == 2 * 28  # prefix caching off: no sharing across requests
    again = engine().generate(prompt, params)[0]  # same seed, another engine: same completions
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_n_streams_one_output_per_request_and_abort_stops_every_completion():
    eng = engine()
    rid = eng.add_request([5, 6, 7], SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        outs = eng.step()
        assert [o.request_id for o in outs] in ([], [rid])
    assert eng.abort(rid)
    final = eng.core.drain()[0]  # the abort's output waits in the core until polled
    assert final.finished and all(c.finish_reason == "abort" for c in final.outputs)
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize(("fields", "message"), [
    ({"n": 2, "best_of": 3}, "best_of is not supported"),
    ({"use_beam_search": True}, "beam search is not implemented"),
    ({"truncate_prompt_tokens": 4}, "prompts are never truncated"),
    ({"n": 2, "temperature": 0.0}, "n must be 1 when using greedy"),
])
def test_unimplemented_parameters_are_rejected(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(fields)


def test_best_of_equal_to_n_is_accepted():
    assert SamplingParams.from_dict({"n": 2, "best_of": 2}).n == 2


def test_n_larger_than_a_worker_holds_is_an_error_for_that_request_only():
    eng = engine(scheduler={"max_num_seqs": 4})
    bad, good = eng.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(n=5, temperature=1.0, max_tokens=3),
                                                      SamplingParams(max_tokens=3)])
    assert bad.error and "n=5" in bad.error and good.error is None and len(good.token_ids) == 3

"""A CPU step's tokens end on a multiple of the linears' call-size step where prompt tokens can fill it.

Under batch invariance every CPU linear is called with a size from a fixed ladder (multiples of
``model.cpu_smallest_row_tile``), so the rows of a step past the last multiple are padding: the scheduler
grows a step's prompt tokens to the largest multiple they fill (``Scheduler._aligned_budget``). It may
only move prompt tokens between steps, never starve a request: every request still finishes.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from cluster.config import load_config
from cluster.engine.setup import step_multiple
from coordinator.coordinator import Coordinator
from coordinator.coordinator_config import CoordinatorConfig, KVSettings, ModelInfo
from processors import SamplingParams
from workers.model.tiny import ensure_tiny_model
from workers.wire import StepResult

VOCAB = 512
ROWS = 8  # fewer rows than requests: a backlog waits
_tokenizer = None


def tokenizer():
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("default"))
    return _tokenizer


def coordinator(multiple: int, budget: int) -> Coordinator:
    tok = tokenizer()
    model = ModelInfo(vocab_size=VOCAB, max_model_len=128, eos_token_id=tok.eos_token_id, generation_config={})
    config = CoordinatorConfig(max_num_seqs=ROWS, num_workers=1, rows_per_worker=ROWS, step_multiple=multiple,
                               kv=KVSettings(num_blocks=2000, block_size=8, max_num_batched_tokens=budget))
    return Coordinator(tok, model, config)


def one_token_each(plan, rng: random.Random) -> list[StepResult]:
    lo, hi = plan.shards.tolist()[0]
    tokens = np.array([rng.randrange(60, VOCAB) for _ in range(lo, hi)], np.int32)
    return [StepResult(0, plan.step, (lo, hi), tokens, np.ones(hi - lo, np.int32), {})]


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.integers(1, 60), min_size=1, max_size=30), shared=st.integers(0, 40),
       max_tokens=st.integers(1, 12), multiple=st.sampled_from([8, 16]), budget=st.sampled_from([32, 48, 64]),
       seed=st.integers(0, 999))
def test_while_prompts_wait_every_step_ends_on_the_multiple_and_every_request_finishes(prompts, shared, max_tokens,
                                                                                      multiple, budget, seed):
    """While more requests wait than a step has rows for, a step's tokens end on the multiple. Prompts that
    share a prefix (a system prompt) find it in the prefix cache, or in the blocks an earlier admission of the
    same step fills: the alignment counts the tokens a step adds as the admissions will. (KV blocks are ample
    here: an admission cut short by free blocks may end a step off the multiple.) Without a backlog, the last
    prompts are finished at once: a held token would cost the batch a step of its own."""
    coord = coordinator(multiple, budget)
    rng = random.Random(seed)
    system = [rng.randrange(60, VOCAB) for _ in range(shared)]
    for i, length in enumerate(prompts):
        coord.add_request(system + [rng.randrange(60, VOCAB) for _ in range(length)],
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"r{i}")
    finished = set()
    for _ in range(2000):
        waiting = coord.num_waiting()
        plan = coord.next_plan()
        if plan is None:
            break
        stayed = len(plan.num_tokens) - (len(plan.update.added) if plan.update is not None else 0)
        backlog = waiting > ROWS - stayed  # more requests waited than the step had free rows for
        counts = np.asarray(plan.num_tokens)
        total = int(counts.sum())
        assert total <= budget
        if backlog:  # aligned, or within one call (padded anyway)
            assert total % multiple == 0 or total <= multiple, (total, counts[counts > 0].tolist())
        coord.accept_step(plan, one_token_each(plan, rng))
        finished.update(o.request_id for o in coord.take_outputs() if o.finished)
    assert not coord.has_unfinished() and finished == {f"r{i}" for i in range(len(prompts))}


def test_without_a_backlog_the_last_prompts_finish_in_one_step():
    """Eight requests, rows for all of them: the first step computes every prompt (61 tokens, not a multiple of
    8) and each request samples at once, as the scheduler without an aim would."""
    coord = coordinator(8, 256)
    lengths = [5, 9, 7, 8, 6, 11, 10, 5]
    for i, length in enumerate(lengths):
        coord.add_request(list(range(60 + i * 20, 60 + i * 20 + length)), SamplingParams(max_tokens=2, ignore_eos=True),
                          request_id=f"r{i}")
    plan = coord.next_plan()
    assert int(np.asarray(plan.num_tokens).sum()) == sum(lengths) == 61


def test_the_multiple_is_the_ladders_step_on_a_single_invariant_cpu_worker_and_one_elsewhere():
    def multiple(**model) -> int:
        return step_multiple(load_config({"model": {"tiny": "default", **model}}))

    assert multiple() == 8  # model.cpu_smallest_row_tile's default: the ladder 8, 16, ..., 56, then 64-row calls
    assert multiple(cpu_smallest_row_tile=16) == 16
    assert multiple(cpu_smallest_row_tile=64) == 64 and multiple(cpu_smallest_row_tile=128) == 64  # the tile alone
    assert multiple(batch_invariant=False) == 1
    assert step_multiple(load_config({"model": {"tiny": "default"}, "cluster": {"num_workers": 2}})) == 1

"""Requests that share a prompt prefix enter the engine side by side: each document computed once, whatever
the input's order, and never a different token for it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.local_engine import LocalEngine
from coordinator.intake.prefix_order import ID_CHUNK, chunk_keys, prefix_order
from processors import SamplingParams

prompts_with_shared_prefixes = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 9), max_size=40)), max_size=30,
).map(lambda items: [[7] * (ID_CHUNK * stem) + tail for stem, tail in items])


@settings(max_examples=200, deadline=None)
@given(prompts_with_shared_prefixes)
def test_the_order_is_a_permutation_that_keeps_every_shared_chunk_together(prompts):
    order = prefix_order(prompts)
    assert sorted(order) == list(range(len(prompts)))
    ranked = [prompts[i] for i in order]
    for depth in range(1, 4):  # the prompts whose first `depth` chunks are one same run stand side by side
        holders = [i for i, p in enumerate(ranked) if chunk_keys(p, depth)[:depth] == chunk_keys([7] * ID_CHUNK * depth)]
        assert holders == list(range(holders[0], holders[0] + len(holders))) if holders else True


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=200), max_size=20, unique_by=lambda t: t.encode("utf-8")[:64]))
def test_prompts_that_share_no_chunk_keep_their_input_order(texts):
    assert prefix_order(texts) == list(range(len(texts)))


def test_a_group_stands_where_its_first_request_stood():
    doc = list(range(10, 10 + 3 * ID_CHUNK))
    prompts = [[1] * ID_CHUNK, doc + [1], [2] * ID_CHUNK, doc + [2], "text", doc + [3], None]
    assert prefix_order(prompts) == [0, 1, 3, 5, 2, 4, 6]


DOCS, QUESTIONS, DOC_LEN = 8, 3, 64


def question_major() -> tuple[list[list[int]], list[int]]:
    """Every document's first question, then every second...; (prompts, request index d * QUESTIONS + q)."""
    rng = random.Random(5)
    docs = [[rng.randrange(3, 500) for _ in range(DOC_LEN)] for _ in range(DOCS)]
    questions = [[rng.randrange(3, 500) for _ in range(6)] for _ in range(DOCS * QUESTIONS)]
    pairs = [(d, q) for q in range(QUESTIONS) for d in range(DOCS)]
    return [docs[d] + questions[d * QUESTIONS + q] for d, q in pairs], [d * QUESTIONS + q for d, q in pairs]


def run(prompts: list[list[int]], index: list[int], grouped: bool, workers: int = 1) -> tuple[dict, int]:
    # 48 blocks of 4 tokens per worker: about two documents with their questions.
    engine = LocalEngine({"model": {"tiny": "default", "max_model_len": 128},
                          "cluster": {"num_workers": workers},
                          "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 128},
                          "cache": {"block_size": 4, "kv_cache_memory": 48 * 4 * 512},
                          "input": {"group_by_prefix": grouped}})
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in index]
    outputs = engine.generate(prompts, params)
    return {i: o.token_ids for i, o in zip(index, outputs)}, engine.stats()["prefill_tokens"]


@pytest.mark.parametrize("workers", [1, 2])
def test_each_document_is_computed_once_in_question_major_order_and_no_token_changes(workers):
    prompts, index = question_major()
    least = DOCS * DOC_LEN + sum(len(p) - DOC_LEN for p in prompts)  # documents once, every question
    grouped, computed = run(prompts, index, grouped=True, workers=workers)
    assert computed <= 1.1 * least, (computed, least)
    in_order, recomputed = run(prompts, index, grouped=False, workers=workers)
    assert recomputed > 2 * least  # admitted as they come, each document is evicted before its next question
    assert grouped == in_order  # seeded sampling is keyed by seed and position, not by schedule
    by_document = sorted(range(len(prompts)), key=index.__getitem__)
    document_major, _ = run([prompts[i] for i in by_document], sorted(index), grouped=True, workers=workers)
    assert document_major == grouped


def test_computed_prompt_tokens_count_every_prompt_token_the_engine_ran():
    """The job's "prompt tokens: X computed of Y given" line: a one-token prompt is computed, not found in
    the cache, and a prompt the cache held but for its last token computes that token."""
    engine = LocalEngine({"model": {"tiny": "default", "max_model_len": 64}, "cache": {"block_size": 4}})
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.generate([[7]], greedy)
    assert (engine.stats()["prompt_tokens"], engine.stats()["prefill_tokens"]) == (1, 1)
    engine.generate([[5, 6, 7, 8, 9]], greedy)  # 5 more given, 5 computed
    engine.generate([[5, 6, 7, 8, 9]], greedy)  # the first block (4 tokens) cached: only the last token computed
    assert (engine.stats()["prompt_tokens"], engine.stats()["prefill_tokens"]) == (11, 7)

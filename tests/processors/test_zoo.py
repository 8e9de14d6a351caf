"""logits-processor-zoo's vLLM request-level processors, named in the config, on the tiny model."""

from __future__ import annotations

import pytest

pytest.importorskip("logits_processor_zoo", reason="the optional 'zoo' extra is not installed")

from cluster.engine.local_engine import LocalEngine  # noqa: E402
from coordinator.request import FinishReason  # noqa: E402
from processors import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return LocalEngine({
        "model": {"tiny": "default", "max_model_len": 128},
        "scheduler": {"max_num_seqs": 4},
        "processors": [
            {"class": "logits_processor_zoo.vllm:GenLengthLogitsProcessor", "request_level": True,
             "enable_with": "gen_length", "kwargs": {"boost_factor": 50.0}},
            {"class": "logits_processor_zoo.vllm.MultipleChoiceLogitsProcessor", "request_level": True,
             "enable_with": "multiple_choice", "kwargs": {"choices": ["1", "2", "3", "4"]}},
        ],
    })


def test_gen_length_ends_generation_early_only_where_enabled(engine):
    eos = engine.tokenizer.eos_token_id
    short, normal, gentle = engine.generate(
        ["Tell me a story", "Tell me a story", "Tell me a story"],
        [
            SamplingParams(temperature=0.0, max_tokens=40, extra_args={"gen_length": True}),
            SamplingParams(temperature=0.0, max_tokens=40),
            SamplingParams(temperature=0.0, max_tokens=40, extra_args={"gen_length": {"boost_factor": 0.0}}),
        ],
    )
    assert short.finish_reason == FinishReason.STOP and short.token_ids[-1] == eos and len(short.token_ids) < 15
    assert normal.finish_reason == FinishReason.LENGTH and len(normal.token_ids) == 40
    assert gentle.token_ids == normal.token_ids  # per-request kwargs override the engine's


def test_multiple_choice_answers_with_a_choice(engine):
    tok = engine.tokenizer
    choice_ids = {tok.encode(c, add_special_tokens=False)[-1] for c in ["1", "2", "3", "4"]}
    question = "Which is best?\n1. red\n2. green\n3. blue\n4. none\nAnswer: "
    picked, free = engine.generate(
        [question, question],
        [SamplingParams(seed=3, max_tokens=3, extra_args={"multiple_choice": True}), SamplingParams(seed=3, max_tokens=3)],
    )
    assert set(picked.token_ids) <= choice_ids and picked.token_ids
    assert not set(free.token_ids) <= choice_ids


def test_bad_per_request_kwargs_are_refused_at_admission(engine):
    bad, wrong_type, good = engine.generate(
        ["Tell me a story"] * 3,
        [
            SamplingParams(max_tokens=4, extra_args={"gen_length": {"no_such_argument": 1}}),
            SamplingParams(max_tokens=4, extra_args={"gen_length": 5}),
            SamplingParams(max_tokens=4, seed=1, extra_args={"gen_length": {"boost_factor": 0.0}}),
        ],
    )
    assert "does not fit logits_processor_zoo.vllm:GenLengthLogitsProcessor" in bad.error
    assert "unexpected keyword argument 'no_such_argument'" in bad.error and bad.token_ids == []  # never ran
    assert "must be true or an object" in wrong_type.error
    assert good.error is None and len(good.token_ids) == 4

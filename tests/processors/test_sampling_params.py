from __future__ import annotations

import json
import pickle

import pytest

from processors import SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be at least 1, got 0"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\], got 3.0"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\], got -2.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0"),
        ({"temperature": -0.1}, r"temperature must be in \[0, 2\], got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_k": -2}, "top_k must be 0 \\(disable\\), or at least 1, got -2"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens must be less than or equal to max_tokens=3, got 5"),
        ({"logprobs": -3}, "logprobs must be non-negative or -1, got -3"),
        ({"stop": ["ok", ""]}, "stop must contain only non-empty strings"),
        ({"stop_token_ids": [1, "x"]}, "stop_token_ids must contain only non-negative integers"),
        ({"bad_words": [""]}, "bad_words must contain only non-empty strings"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids must contain only non-negative integers"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias contains key\\(s\\) that are not integer token ids"),
        ({"logit_bias": {1: "big"}}, "logit_bias values must be finite numbers"),
        ({"thinking_token_budget": -5}, "thinking_token_budget must be a non-negative integer or -1"),
        ({"temperature": 0.0, "n": 2}, "n must be 1 when using greedy sampling"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"extra_args": [1]}, "extra_args must be a mapping"),
        # vLLM's fields raysample does not implement: a ValueError naming them, as the dict path gives
        ({"prompt_logprobs": -2}, "^prompt_logprobs must be non-negative or -1"),
        ({"prompt_logprobs": 1.5}, "^prompt_logprobs must be an integer"),
        ({"best_of": 3, "n": 2, "temperature": 1.0}, "^best_of is not supported"),
        ({"truncate_prompt_tokens": 8}, "^truncate_prompt_tokens is not supported: prompts are never truncated"),
        ({"logits_processors": [print]}, "^logits_processors is not supported: per-request callables"),
    ],
)
def test_invalid_values_name_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation_follow_vllm():
    p = SamplingParams(stop="x", top_k=-1, seed=-1, logit_bias={"3": 500, 4: -1.5}, thinking_token_budget=-1)
    assert p.stop == ["x"]
    assert p.top_k == 0 and p.seed is None and p.thinking_token_budget is None
    assert p.logit_bias == {3: 100.0, 4: -1.5}
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_p == 1.0
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)
    assert greedy.sampling_type == SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.001).temperature == 0.01


def test_all_stop_token_ids_include_eos_once_set():
    p = SamplingParams(stop_token_ids=[7, 7, 9])
    assert p.stop_token_ids == [7, 9]
    assert p.all_stop_token_ids == {7, 9}
    p.update_from_generation_config({"eos_token_id": [2, 3]}, eos_token_id=2)
    assert p.all_stop_token_ids == {2, 3, 7, 9}
    assert p.eos_token_id == 2
    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({}, eos_token_id=2)
    assert ignoring.eos_token_id is None
    assert ignoring.all_stop_token_ids == {2}  # min_tokens still masks EOS, as vLLM


def test_pickle_and_dict_round_trip():
    p = SamplingParams(
        temperature=0.7, top_k=20, logit_bias={5: 2.0}, stop=["\n"], extra_args={"target_token": 3}, seed=11
    )
    p.update_from_generation_config({}, eos_token_id=1)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.all_stop_token_ids == {1}
    as_json = json.loads(json.dumps(p.to_dict()))
    assert SamplingParams.from_dict(as_json) == p
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_vllms_unsupported_fields_at_their_defaults_pass_and_stay_out_of_the_dict():
    p = SamplingParams(truncate_prompt_tokens=None, best_of=2, n=2, temperature=1.0, logits_processors=[])
    assert p == SamplingParams(n=2, temperature=1.0) and p.to_dict() == {"n": 2}
    assert p.best_of is None and p.logits_processors is None
    with pytest.raises(ValueError, match="^sampling_params.truncate_prompt_tokens is not supported"):
        SamplingParams.from_dict({"truncate_prompt_tokens": 2})


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['temprature'\]"):
        SamplingParams.from_dict({"temprature": 0.5})

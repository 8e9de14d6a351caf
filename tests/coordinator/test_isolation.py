"""One request never costs another its output (in process; tests/cluster/ray/test_ray.py repeats it on Ray).

Misbehaving processors live in ``failing_processors``: one makes its request's logits NaN, one puts
a +inf in them, one raises for a request it does not name, one sleeps for a minute at its request's
third token. Each time only the culprit fails, with an error saying what happened; every other
request finishes with exactly the tokens of a clean run.
"""

from __future__ import annotations

import pytest

from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams

PROCESSORS = ["failing_processors:NonFinite", "failing_processors:PlusInf", "failing_processors:BoomLate",
              "failing_processors:HangsAtThirdToken"]
PROMPTS = ["Hello there", "The quick brown fox", "café 你好", "Numbers like 0 1 2 3", "batch", "a b c a b c",
           "Think first", "Unicode matters", "one more", "and the last"]


def engine(**cluster) -> LocalEngine:
    return LocalEngine({"model": {"tiny": "default", "max_model_len": 128},
                        "scheduler": {"max_num_seqs": 8, "consistency_check_every": 1},
                        "cluster": {"num_workers": 2, **cluster}, "processors": PROCESSORS})


def innocent(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=8 + i, ignore_eos=True)


@pytest.fixture(scope="module")
def clean() -> list[list[int]]:
    return [o.token_ids for o in engine().generate(PROMPTS, [innocent(i) for i in range(len(PROMPTS))])]


def run_with(eng: LocalEngine, bad: dict[int, SamplingParams]) -> list:
    prompts = PROMPTS + [f"bad {i}" for i in bad]
    params = [innocent(i) for i in range(len(PROMPTS))] + list(bad.values())
    return eng.generate(prompts, params)


def test_non_finite_logits_fail_only_their_request(clean):
    eng = engine()
    tok = eng.tokenizer
    word = next(w for w in ("the", "a", "hello", "x") if len(tok.encode(w, add_special_tokens=False)) == 1)
    only = tok.encode(word, add_special_tokens=False)
    bad = {0: SamplingParams(max_tokens=6, extra_args={"boom": "nan"}),
           1: SamplingParams(max_tokens=6, temperature=0.8, seed=3, extra_args={"boom": "inf"}),
           2: SamplingParams(max_tokens=6, allowed_token_ids=only, bad_words=[word])}  # exclude each other
    outs = run_with(eng, bad)
    for i, out in enumerate(outs[: len(PROMPTS)]):
        assert out.error is None and out.token_ids == clean[i], i
    nan, inf, masked = outs[len(PROMPTS):]
    assert "logits contain NaN after logits processor failing_processors.NonFinite" in nan.error, nan.error
    assert "logits contain +inf after logits processor failing_processors.PlusInf" in inf.error, inf.error
    assert "every token is masked (-inf) by this request's constraints" in masked.error, masked.error
    assert not (nan.retryable or inf.retryable or masked.retryable)
    assert eng.generate("Hello there", innocent(0))[0].token_ids == clean[0]  # the engine goes on


def test_a_failure_no_request_explains_is_narrowed_to_its_culprit(clean):
    eng = engine()
    outs = run_with(eng, {0: SamplingParams(max_tokens=30, extra_args={"boom": "late"})})
    for i, out in enumerate(outs[: len(PROMPTS)]):
        assert out.error is None and out.token_ids == clean[i], (i, out.error)
    culprit = outs[-1]
    assert "made the engine fail on its own" in culprit.error and "failed for a request it does not name" in culprit.error
    assert not culprit.retryable  # a resumed job does not run it again
    assert eng.coordinator.quarantine.failures == {} and not eng.coordinator.quarantine


def test_a_hung_processor_is_abandoned_and_its_request_found(clean, monkeypatch):
    monkeypatch.setenv("RAYSAMPLE_TEST_HANG_S", "6")
    eng = engine(call_timeout_s=2.0, max_worker_replacements=1)  # finding the culprit costs no replacement
    outs = run_with(eng, {0: SamplingParams(max_tokens=6, extra_args={"hang": True})})
    for i, out in enumerate(outs[: len(PROMPTS)]):
        assert out.error is None and out.token_ids == clean[i], (i, out.error)
    assert "made the engine fail on its own" in outs[-1].error and "hung (no answer in 2s)" in outs[-1].error
    assert eng.executor.replacements <= 1
    assert eng.generate("Hello there", innocent(0))[0].token_ids == clean[0]


def test_non_finite_logits_under_speculative_decoding(clean):
    """Drafts are verified position by position; the NaN row fails at the first, the others verify as usual."""
    spec = LocalEngine({"model": {"tiny": "default", "max_model_len": 128},
                        "scheduler": {"max_num_seqs": 8, "consistency_check_every": 1},
                        "speculative": {"num_speculative_tokens": 3, "draft_policy": "fixed"},
                        "cluster": {"num_workers": 2}, "processors": PROCESSORS})
    outs = run_with(spec, {0: SamplingParams(max_tokens=6, temperature=0.9, seed=1, extra_args={"boom": "nan"})})
    for i, out in enumerate(outs[: len(PROMPTS)]):
        assert out.error is None and out.token_ids == clean[i], (i, out.error)  # spec decode is exact
    assert "logits contain NaN after logits processor failing_processors.NonFinite" in outs[-1].error
    assert spec.coordinator.metrics.spec_proposed > 0


def test_the_quarantine_halves_suspects_and_convicts_one_alone_at_its_second_failure():
    from coordinator.intake.quarantine import Quarantine

    q = Quarantine()
    assert q.failed(["a", "b", "c", "d", "e"]) == []  # a first failure: five suspects, in halves
    assert [q.admits(r) for r in "abcde"] == [True, True, True, False, False]  # only the first half runs
    assert q.failed(["a", "b", "c"]) == []  # it fails again: halves of it
    assert [q.admits(r) for r in "abc"] == [True, True, False]
    q.finished("a"), q.finished("b")  # that group finishes: the next one runs
    assert [q.admits(r) for r in "cde"] == [True, False, False]
    assert q.failed(["c"]) == ["c"]  # alone, at its second failure: convicted
    q.finished("c")
    assert [q.admits(r) for r in "de"] == [True, True] and q.failures == {"d": 1, "e": 1}
    q.finished("d"), q.finished("e")
    assert not q and q.admits("f")  # empty: everyone is admitted again
    assert q.failed(["z"]) == [] and q.failed(["z"]) == ["z"]  # a first failure alone is retried once

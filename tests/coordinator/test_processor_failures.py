"""A processor that raises (or returns a bad tensor) fails only the requests that make it fail: those
it names, else those that fail when replayed alone through a fresh instance; when no request alone
fails it, the engine's quarantine runs the step's requests apart until the culprit is alone
(tests/coordinator/test_isolation.py). Every other request's output is what it would have been; the engine goes on."""

from __future__ import annotations

import pytest

from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams

PROCESSORS = ["failing_processors:BoomAdapter", "failing_processors:BoomBatch", "failing_processors:BoomV2",
              "failing_processors:WrongShape", "failing_processors:BoomWhenCrowded"]
PROMPTS = ["Hello there", "The quick brown fox", "café 你好", "Numbers like 0 1 2 3", "batch", "a b c a b c",
           "Think first", "Unicode matters"]


def engine(workers: int = 2) -> LocalEngine:
    return LocalEngine({"model": {"tiny": "default", "max_model_len": 128},
                        "scheduler": {"max_num_seqs": 4, "consistency_check_every": 1},
                        "cluster": {"num_workers": workers}, "processors": PROCESSORS})


def innocent(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10 + i, ignore_eos=True)


@pytest.fixture(scope="module")
def clean() -> list[list[int]]:
    return [o.token_ids for o in engine().generate(PROMPTS, [innocent(i) for i in range(len(PROMPTS))])]


@pytest.mark.parametrize("tag", ["apply", "build", "v2", "batch", "shape"])
def test_only_requests_enabling_the_processor_fail(clean, tag):
    eng = engine()
    tagged = {1, 5}
    params = [SamplingParams(max_tokens=8, extra_args={"boom": tag}) if i in tagged else innocent(i)
              for i in range(len(PROMPTS))]
    outs = eng.generate(PROMPTS, params)
    for i, out in enumerate(outs):
        if i in tagged:
            assert out.error and "failing_processors." in out.error, out.error
            assert any(m in out.error for m in ("exploded", "cannot build", "expected torch.float32")), out.error
        else:
            assert out.error is None and out.token_ids == clean[i], i
    again = eng.generate("Hello there", innocent(0))[0]  # the engine keeps serving
    assert again.token_ids == clean[0]


def test_a_failure_only_two_requests_cause_together_ends_when_they_run_apart(clean):
    """No request alone makes BoomWhenCrowded raise: the quarantine runs the step's requests apart
    (in halves), where nothing fails, so every request finishes, the innocent ones as in a clean run."""
    eng = engine()
    crowd = [eng.add_request(p, SamplingParams(max_tokens=5, extra_args={"boom": "crowd"})) for p in ("x", "y")]
    ids = [eng.add_request(p, innocent(i)) for i, p in enumerate(PROMPTS[:2])]  # max_num_seqs = 4: all at once
    outs = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
    assert all(outs[r].error is None and len(outs[r].token_ids) == 5 for r in crowd)
    assert [outs[r].token_ids for r in ids] == clean[:2]
    later = eng.generate(PROMPTS[3:5], [innocent(3), innocent(4)])
    assert [o.token_ids for o in later] == clean[3:5]

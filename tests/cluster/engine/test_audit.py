"""The consistency audit names the worker, row or processor that diverged."""

from __future__ import annotations

import os

import pytest

from cluster.engine.audit import ConsistencyError, check_consistency
from cluster.engine.local_engine import LocalEngine
from processors import LogitsProcessor, SamplingParams
from workers.wire import StepResult


class DivergentProcessor(LogitsProcessor):
    """Each replica reports a different state: what a nondeterministic processor looks like."""

    def __init__(self, config, device, is_pin_memory):
        self.token = os.urandom(8)

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        return logits

    def state_digest(self) -> bytes:
        return self.token


def result(worker: int, rows: list[bytes], procs: dict[str, bytes]) -> StepResult:
    return StepResult(worker_id=worker, step=7, rows=(0, 0), tokens=[], row_digests=rows, processor_digests=procs)


def test_row_mismatch_names_worker_and_row():
    with pytest.raises(ConsistencyError, match="step 7: worker 1 disagrees with worker 0 on batch row 2"):
        check_consistency(7, [result(0, [b"a", b"b", b"c"], {}), result(1, [b"a", b"b", b"X"], {})])


def test_processor_mismatch_names_processor():
    with pytest.raises(ConsistencyError, match="worker 2 .* on the state of processor my.Proc"):
        check_consistency(7, [result(0, [b"a"], {"my.Proc": b"1"}), result(1, [b"a"], {"my.Proc": b"1"}),
                              result(2, [b"a"], {"my.Proc": b"2"})])


def test_engine_stops_on_divergent_replicas():
    engine = LocalEngine({
        "model": {"tiny": "default", "max_model_len": 64},
        "cluster": {"num_workers": 2},
        "scheduler": {"max_num_seqs": 4, "consistency_check_every": 1},
        "processors": ["test_audit:DivergentProcessor"],
    })
    with pytest.raises(ConsistencyError, match="on the state of processor test_audit.DivergentProcessor"):
        engine.generate(["Hello", "World"], SamplingParams(max_tokens=4))


def test_identical_replicas_pass_for_hundreds_of_steps_with_churn():
    engine = LocalEngine({
        "model": {"tiny": "default", "max_model_len": 96},
        "cluster": {"num_workers": 3},
        "scheduler": {"max_num_seqs": 5, "consistency_check_every": 1},
        "processors": ["processors.examples:DummyLogitsProcessor", "processors.examples:WrappedPerReqLogitsProcessor"],
    })
    prompts = [f"request {i} " + "ab " * (i % 7) for i in range(60)]
    params = [SamplingParams(seed=i, max_tokens=3 + (i * 7) % 19, ignore_eos=True, min_tokens=i % 3,
                             extra_args={"target_token": 30 + i} if i % 5 == 0 else None,
                             repetition_penalty=1.1 if i % 2 else 1.0) for i in range(60)]
    outputs = engine.generate(prompts, params)
    assert engine.coordinator.metrics.steps >= 100
    assert all(o.error is None for o in outputs)

"""The pipelined step (``scheduler.async_scheduling``, the default): a worker launches its next
forward before the next plan arrives, and outputs stay exactly those of the synchronous step."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from golden_engine import GOLDEN, SETUPS, assert_same_record, run_setup
from recording_processor import RecordingProcessor

from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams
from workers.doubles.simulated_runner import ComputeModel, SimulatedRunner
from workers.row_work import RowWork
from workers.step.ahead import Forwards, guess_next

EXPECTED = json.loads(GOLDEN.read_text())


def sync(extra: dict) -> dict:
    scheduler = {"max_num_seqs": 12, "max_num_batched_tokens": 96, "consistency_check_every": 1}
    return {**extra, "scheduler": {**scheduler, "async_scheduling": False}}


@pytest.mark.parametrize("name", ["w2-tight", "w2-features"])
def test_the_synchronous_switch_reproduces_the_goldens(name):
    """The goldens run pipelined in test_golden_engine; here synchronously, as they were recorded."""
    _, workers, extra = next(s for s in SETUPS if s[0] == name)
    got = run_setup(workers, sync(extra))
    assert got["ahead_rows"] == 0
    for rid, expected in EXPECTED[name]["outputs"].items():
        assert_same_record(got["outputs"][rid], expected, rid)
    assert got["steps"] == EXPECTED[name]["steps"]


def test_the_pipelined_goldens_take_most_rows_from_the_forward_launched_ahead():
    """Not a timing: the pipeline is engaged (without it test_golden_engine would pass trivially)."""
    _, workers, extra = next(s for s in SETUPS if s[0] == "w2-tight")
    got = run_setup(workers, extra)
    assert got["ahead_rows"] > 0.5 * sum(len(c["token_ids"]) for r in got["outputs"].values()
                                         for c in r["completions"])


def test_processors_see_the_same_batch_updates_and_tokens_as_in_the_synchronous_step():
    """Every replica's log of BatchUpdates and of the output lists at every apply, pipelined vs synchronous:
    equal (no placeholder token, no extra step of a finished row, ever reaches a processor)."""
    logs = {}
    for pipelined in (False, True):
        RecordingProcessor.replicas = []
        engine = LocalEngine({"model": {"tiny": "loopy", "max_model_len": 96}, "cluster": {"num_workers": 2},
                              "scheduler": {"max_num_seqs": 6, "max_num_batched_tokens": 48,
                                            "async_scheduling": pipelined, "consistency_check_every": 1},
                              "cache": {"block_size": 4},
                              "processors": ["recording_processor:RecordingProcessor"]})
        prompts = [f"row {i} " + "fox " * (i % 5) for i in range(14)]
        params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8, seed=i, max_tokens=3 + 2 * i,
                                 stop=["e"] if i % 4 == 1 else None, n=2 if i == 5 else 1) for i in range(14)]
        outs = engine.generate(prompts, params)
        logs[pipelined] = ([r.log for r in RecordingProcessor.replicas],
                           [[c.token_ids for c in o.outputs] for o in outs])
        if pipelined:
            assert engine.stats()["ahead_rows"] > 0
        engine.shutdown()
    assert logs[True][1] == logs[False][1]
    assert len(logs[True][0]) == len(logs[False][0]) == 2
    for pipelined_log, sync_log in zip(logs[True][0], logs[False][0]):
        assert pipelined_log == sync_log


class BlockingRunner(SimulatedRunner):
    """A simulated GPU whose forward ends only when the test lets it."""

    def __init__(self) -> None:
        super().__init__(ComputeModel(0.0, 0.0), vocab_size=32, max_model_len=64, num_blocks=16, block_size=4,
                         sleep=lambda s: None)
        self.gate = threading.Event()
        self.calls: list[list[int]] = []

    def forward(self, rows):
        self.calls.append([r.token_ids[-1] for r in rows])
        self.gate.wait()
        return super().forward(rows)


def test_a_launch_returns_at_once_and_only_the_rows_the_plan_keeps_use_it():
    runner = BlockingRunner()
    forwards = Forwards(runner)
    step = [RowWork([0], [1, 2, 3], 0), RowWork([1, 5], [4], 4, decode=True), RowWork([2, 3], [5], 7, decode=True)]
    ids, guessed = guess_next(["a", "b", "c"], step, sampled=[7, 8, 9], errors=set(), block_size=4,
                              max_model_len=64)
    assert ids == ["a", "b"]  # "c" would write position 8: a block it does not hold yet
    assert [(g.token_ids, g.start_pos) for g in guessed] == [([7], 3), ([8], 5)]
    forwards.launch_ahead(ids, guessed)  # returns while the forward cannot end
    assert not runner.gate.is_set()
    # The plan: "b" as guessed (moved first), "a" with another token (not what was guessed), "d" new.
    plan = [RowWork([1, 5, 6], [8], 5, decode=True), RowWork([0], [6], 3, decode=True), RowWork([4], [1, 2], 0)]
    runner.gate.set()
    got = forwards.forward(["b", "a", "d"], plan)
    assert (got.ahead_rows, got.wasted_rows) == (1, 1)
    assert runner.calls[-1] == [6, 2]  # the second forward computes only what the guess did not
    reference = SimulatedRunner(ComputeModel(0.0, 0.0), 32, 64, 16, 4, sleep=lambda s: None).forward(plan)
    assert torch.equal(got.logits, reference)
    forwards.shutdown()


def test_a_failed_launched_forward_fails_the_step_that_uses_it():
    class Failing(BlockingRunner):
        def forward(self, rows):
            raise RuntimeError("device lost")

    forwards = Forwards(Failing())
    forwards.launch_ahead(["a"], [RowWork([0], [1], 0, decode=True)])
    with pytest.raises(RuntimeError, match="device lost"):
        forwards.forward(["a"], [RowWork([0], [1], 0, decode=True)])
    forwards.shutdown()


def test_vllm_users_switch_it_by_its_vllm_name():
    from cluster.entrypoints.llm_args import config_from_llm_args

    assert config_from_llm_args({"tiny": "loopy"}, async_scheduling=False).scheduler.async_scheduling is False
    assert config_from_llm_args({"tiny": "loopy"}).scheduler.async_scheduling is None  # by device: on for GPUs


def test_a_row_entering_a_new_block_is_guessed_into_a_spare_one_and_moved_where_the_plan_says():
    runner = BlockingRunner()
    runner.spare_blocks = [16]
    moved = []
    runner.copy_blocks = lambda sources, targets: moved.append((sources, targets))
    runner.gate.set()
    forwards = Forwards(runner)
    step = [RowWork([2, 3], [5], 7, decode=True), RowWork([4, 5], [6], 7, decode=True)]
    ids, guessed = guess_next(["c", "e"], step, sampled=[9, 10], errors=set(), block_size=4, max_model_len=64,
                              spare_blocks=runner.spare_blocks)
    assert ids == ["c"] and guessed[0].block_table == [2, 3, 16]  # one spare: "e" waits for its plan
    forwards.launch_ahead(ids, guessed)
    got = forwards.forward(["c", "e"], [RowWork([2, 3, 11], [9], 8, decode=True), RowWork([4, 5, 12], [10], 8,
                                                                                          decode=True)])
    assert (got.ahead_rows, got.wasted_rows) == (1, 0) and moved == [([16], [11])]
    forwards.launch_ahead(*guess_next(["c"], [RowWork([2, 3, 11], [9], 8, decode=True)], [1], set(), 4, 64, [16]))
    got = forwards.forward(["c"], [RowWork([2, 3, 7], [1], 9, decode=True)])  # another block than guessed: recomputed
    assert (got.ahead_rows, got.wasted_rows) == (0, 1) and len(moved) == 1
    forwards.shutdown()


def test_asking_for_the_pipelined_step_with_speculative_decoding_is_refused():
    from cluster.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="async_scheduling: true cannot be used with speculative decoding"):
        load_config({"model": {"tiny": "loopy"}, "scheduler": {"async_scheduling": True},
                     "speculative": {"num_speculative_tokens": 2}})

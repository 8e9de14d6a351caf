"""The adaptive draft policy: step-cost fit, acceptance history, and what it verifies under load."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.engine.local_engine import LocalEngine
from coordinator.spec.draft_policy import DraftPolicy, StepCostModel
from processors import SamplingParams


def test_cost_model_recovers_fixed_and_per_position_cost_from_noisy_steps():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(200):
        positions = rng.randint(8, 64)
        model.observe(positions, (0.004 + 0.0003 * positions) * rng.uniform(0.97, 1.03))
    fixed, per_position = model.fit
    assert fixed == pytest.approx(0.004, rel=0.15)
    assert per_position == pytest.approx(0.0003, rel=0.05)


def test_cost_model_needs_varied_steps_and_shrugs_off_a_pause():
    model = StepCostModel()
    for _ in range(50):
        model.observe(16, 0.01)
    assert model.fit is None  # one position count: the slope is unknown
    for positions in (8, 64) * 20:
        model.observe(positions, 0.002 + 0.001 * positions)
    before = model.fit
    model.observe(32, 1.0)  # a garbage-collection pause, clipped
    assert model.fit[1] == pytest.approx(before[1], rel=0.1)


def fitted(fixed: float, per_position: float) -> DraftPolicy:
    policy = DraftPolicy()
    for positions in (4, 64) * 10:
        policy.cost.observe(positions, fixed + per_position * positions)
    assert policy.cost.fit == pytest.approx((fixed, per_position))
    return policy


def test_without_a_cost_estimate_every_proposal_is_verified():
    policy = DraftPolicy()
    proposals = {"a": [1, 2, 3], "b": [], "c": [4]}
    assert policy.choose(proposals, 3) == {"a": [1, 2, 3], "c": [4]}


def test_drafts_are_kept_when_the_step_is_mostly_fixed_cost():
    policy = fitted(fixed=0.010, per_position=0.0001)
    proposals = {f"r{i}": [1, 2, 3] for i in range(4)}
    assert policy.choose(proposals, 4) == proposals  # prior acceptance 1/2: gains 0.5, 0.25, 0.125 all pay


def test_under_compute_bound_load_only_rows_that_are_usually_right_keep_drafts():
    policy = fitted(fixed=0.030, per_position=0.001)
    for _ in range(10):
        policy.observe("good", proposed=3, accepted=3)
        policy.observe("bad", proposed=3, accepted=0)
    assert policy.rate("good") > 0.9 > 0.3 > policy.rate("bad")
    proposals = {"good": [1, 2, 3], "bad": [4, 5, 6], **{f"r{i}": [7] for i in range(62)}}
    chosen = policy.choose(proposals, 64)  # break-even gain about 1.25 * 0.064 / 0.094 = 0.85
    assert chosen["good"][0] == 1
    assert "bad" not in chosen
    # Rows with no history of their own sit at the batch-wide rate, below what a position costs here.
    assert not any(rid.startswith("r") for rid in chosen)


def test_a_row_is_cut_at_the_first_position_that_does_not_pay():
    policy = fitted(fixed=0.010, per_position=0.001)
    for _ in range(10):
        policy.observe("row", proposed=4, accepted=2)  # tried 3 positions, took 2: rate about 2/3
    assert policy.rate("row") == pytest.approx(2 / 3, abs=0.02)
    # Gains .67 .44 .30 .20; break-even 1.25 * 0.001 * tokens / cost rises from 0.21 to 0.28 as drafts are taken.
    assert policy.choose({"row": [1, 2, 3, 4]}, 2) == {"row": [1, 2, 3]}


def test_every_draft_depth_costs_a_sampling_pass():
    policy = fitted(fixed=0.010, per_position=0.0001)
    proposals = {f"r{i}": [1, 2, 3] for i in range(4)}
    assert policy.choose(proposals, 4) == proposals
    policy.pass_s = 0.004  # a pass costs as much as 40 positions: only the first depth pays
    assert policy.choose(proposals, 4) == {rid: [1] for rid in proposals}
    policy.pass_s = 0.1  # dearer than anything a draft can win
    assert policy.choose(proposals, 4) == {}


def test_with_nothing_waiting_only_the_rows_with_most_tokens_left_matter():
    assert DraftPolicy.critical_rows({"a": 100, "b": 95, "c": 40}) == ["a", "b"]


class OneRowDrafts:
    """Drafts [5, 6, 7] for the row whose prompt starts with ``first`` and nothing for any other."""

    def __init__(self, coordinator, first: int) -> None:
        self.table, self.first = coordinator.scheduler.table, first

    def propose(self, slots: np.ndarray, rooms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        counts = [min(3, max(int(room), 0)) if self.table.requests[slot].prompt_token_ids[0] == self.first else 0
                  for slot, room in zip(slots.tolist(), rooms.tolist())]
        return np.array(counts, np.int32), np.array([t for c in counts for t in [5, 6, 7][:c]], np.int32)


def proposals(coordinator, requests, budget: int) -> dict[str, list[int]]:
    slots = np.array([r.slot for r in requests], dtype=np.int64)
    counts, flat = coordinator._propose(slots, budget)
    out, at = {}, 0
    for request, count in zip(requests, counts.tolist()):
        if count:
            out[request.request_id] = flat[at : at + count].tolist()
        at += count
    return out


def test_a_closed_batch_is_not_drafted_unless_its_critical_rows_all_have_drafts():
    """Nothing waiting for a row: drafts for some rows would shorten nothing."""
    engine = LocalEngine({"model": {"tiny": "loopy", "max_model_len": 192}, "scheduler": {"max_num_seqs": 4},
                          "speculative": {"num_speculative_tokens": 3}})
    coordinator = engine.coordinator
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    ids = [coordinator.add_request(p, params) for p in ("a b a b a b a b", "1 2 3 4 5 6 7 8")]
    engine.step()  # both prompts prefilled
    rows = [coordinator.rows[rid] for rid in ids]
    coordinator._drafts = OneRowDrafts(coordinator, rows[0].prompt_token_ids[0])
    coordinator.draft_policy.cost._fit = (0.01, 0.0001)  # a step costs mostly its fixed part: drafts are cheap
    assert not coordinator.scheduler.waiting
    assert proposals(coordinator, rows, budget=100) == {}  # the other critical row has nothing to verify
    coordinator.add_request("x y z", params)  # now a row finishing early frees a row someone needs
    assert proposals(coordinator, rows, budget=100) == {ids[0]: [5, 6, 7]}


def test_forgetting_a_finished_row_drops_its_history():
    policy = DraftPolicy()
    policy.observe("x", proposed=2, accepted=0)
    assert policy.rate("x") < policy.rate("y")
    policy.forget("x")
    assert policy.rate("x") == policy.rate("y")


def test_adaptive_spec_output_equals_output_without_spec():
    """Whatever the policy verifies (it follows wall-clock step times), outputs stay exact."""
    base = {"model": {"tiny": "loopy", "max_model_len": 192}, "scheduler": {"max_num_seqs": 4}}
    prompts = ["a b c a b c a b c", "1 2 1 2 1 2 1 2", "Hello there", "x y z x y"]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=t, seed=i)
              for i, t in enumerate((0.0, 0.0, 1.0, 0.7))]
    plain = LocalEngine(base).generate(prompts, params)
    engine = LocalEngine({**base, "speculative": {"num_speculative_tokens": 4}})
    assert engine.coordinator.draft_policy is not None
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]

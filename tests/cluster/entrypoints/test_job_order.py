"""A job reads ahead and submits the lines that share a prompt prefix side by side, window by window."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import tiny_job_config

from cluster.config import load_config
from cluster.engine.local_engine import LocalEngine
from cluster.entrypoints.job_runner import run_job

DOCS, QUESTIONS = 4, 3


class RecordingEngine(LocalEngine):
    """The in-process engine, noting the prompts in the order the job submits them."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.submitted: list[list[int]] = []

    def submit_many(self, prompts, sampling_params=None, request_ids=None, final_only=False):
        self.submitted += [list(p) for p in prompts]
        return super().submit_many(prompts, sampling_params, request_ids, final_only)


def question_major_file(path: Path) -> list[list[int]]:
    """4 documents x 3 questions, every document's first question first; the prompts in file order."""
    rng = random.Random(3)
    docs = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(DOCS)]
    prompts = [docs[d] + [rng.randrange(3, 500) for _ in range(5)] for _ in range(QUESTIONS) for d in range(DOCS)]
    path.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "sampling_params": {"seed": i, "max_tokens": 3}})
                            + "\n" for i, p in enumerate(prompts)))
    return prompts


@pytest.mark.parametrize(("grouped", "window", "expected"), [
    # Lines 0-5 are d0q0 d1q0 d2q0 d3q0 d0q1 d1q1: grouped within the window, then lines 6-11.
    (True, 6, [0, 4, 1, 5, 2, 3, 6, 10, 7, 11, 8, 9]),
    (True, 100, [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]),
    (False, 100, list(range(12))),
])
def test_lines_sharing_a_prefix_are_submitted_together_within_each_window(tmp_path, grouped, window, expected):
    prompts = question_major_file(tmp_path / "in.jsonl")
    config = tiny_job_config()
    config["input"] = {"group_by_prefix": grouped, "read_ahead_lines": window}
    config = load_config(config)
    engine = RecordingEngine(config)
    counters = run_job(config, engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", max_in_flight=4)
    assert engine.submitted == [prompts[i] for i in expected]
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert counters.done == 12 and sorted(r["id"] for r in records) == list(range(12))
    assert all(len(r["token_ids"]) == 3 and r["error"] is None for r in records)

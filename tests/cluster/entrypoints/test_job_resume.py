"""Resume is exact and bad lines stay alone: run_job in one process with the in-process engine."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_job_config

from cluster.config import load_config
from cluster.engine.local_engine import LocalEngine
from cluster.entrypoints.job_formats import GenerateFormat, OpenAIBatchFormat
from cluster.entrypoints.job_records import OutputLocked, lock_output
from cluster.entrypoints.job_runner import run_job

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def config():
    data = tiny_job_config()
    data["scheduler"]["max_num_seqs"] = 4
    data["cluster"]["num_workers"] = 1
    return load_config(data)


@pytest.fixture(scope="module")
def backend(config):
    return LocalEngine(config)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def unseeded(i: int) -> dict:
    return {"id": f"u{i}", "prompt": f"random {i}", "sampling_params": {"temperature": 1.0, "max_tokens": 6}}


def test_resumed_unseeded_requests_equal_an_uninterrupted_run(config, backend, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(unseeded(i)) + "\n" for i in range(8)))
    whole = tmp_path / "whole.jsonl"
    run_job(config, backend, source, whole, max_in_flight=4)
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(line + "\n" for line in whole.read_text().splitlines()[:3]))
    counters = run_job(config, backend, source, partial, max_in_flight=4)
    assert counters.skipped == 3 and counters.done == 5
    by_id = lambda path: {r["id"]: r["token_ids"] for r in records(path)}  # noqa: E731
    assert by_id(partial) == by_id(whole) and len(by_id(whole)) == 8
    assert len({tuple(t) for t in by_id(whole).values()}) > 1  # unseeded rows do draw different streams


def test_bad_lines_get_one_record_each_and_a_fixed_line_runs_again(config, backend, tmp_path):
    good = {"id": 1, "prompt": "fine", "sampling_params": {"seed": 1, "max_tokens": 4}}
    lines = [
        json.dumps(good).encode(),
        json.dumps({"id": "1", "prompt": "same id as 1"}).encode(),           # ids compare as strings
        json.dumps({"id": 1.5, "prompt": "float id"}).encode(),
        json.dumps({"id": "sp", "prompt": "x", "sampling_params": "max_tokens=3"}).encode(),
        json.dumps({"id": "list", "prompt": "x", "sampling_params": [1, 2]}).encode(),
        b'{"id": "bytes", "prompt": "caf\xe9"}',                               # latin-1, not UTF-8
        json.dumps({"id": "lp", "prompt": "x", "sampling_params": {"logprobs": 10**6}}).encode(),
        json.dumps({"id": "after", "prompt": "still runs", "sampling_params": {"seed": 2, "max_tokens": 3}}).encode(),
    ]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    output = tmp_path / "out.jsonl"
    counters = run_job(config, backend, source, output, max_in_flight=4)
    out = records(output)
    assert len(out) == len(lines) and counters.errors == 6 and counters.done == 2
    errors = {r.get("line"): r["error"] for r in out if r.get("error")}
    assert "duplicate id '1'" in errors[2]
    assert "'id' must be a non-empty string or an integer, got 1.5" in errors[3]
    assert "'sampling_params' must be an object, got str" in errors[4] and "got list" in errors[5]
    assert "not valid UTF-8 (byte 0xe9" in errors[6]
    lp = next(r for r in out if r["id"] == "lp")
    assert "greater than max allowed" in lp["error"] and lp["input_sha"] and not lp.get("retryable")
    assert {r["id"] for r in out if r.get("error") is None} == {1, "after"}

    # Re-run: every line has a final record, nothing runs.
    again = run_job(config, backend, source, output, max_in_flight=4)
    assert again.skipped == len(lines) and again.done == again.errors == 0
    # Fix two lines: only they run; the others stay done.
    lines[3] = json.dumps({"id": "sp", "prompt": "x", "sampling_params": {"max_tokens": 3, "seed": 3}}).encode()
    lines[6] = json.dumps({"id": "lp", "prompt": "x", "sampling_params": {"logprobs": 2, "max_tokens": 2}}).encode()
    source.write_bytes(b"\n".join(lines) + b"\n")
    fixed = run_job(config, backend, source, output, max_in_flight=4)
    assert fixed.done == 2 and fixed.errors == 0 and fixed.skipped == len(lines) - 2
    newest = {r["id"]: r for r in records(output) if r.get("id") in ("sp", "lp") and r.get("error") is None}
    assert len(newest["sp"]["token_ids"]) == 3 and len(newest["lp"]["logprobs"][0]["top"]) == 2


class FlakyBackend:
    """Reports an engine-side (retryable) failure for the requests named, as when every worker is gone."""

    def __init__(self, inner: LocalEngine, failing: set[str]) -> None:
        self.inner, self.failing = inner, failing

    def stats(self):
        return self.inner.stats()

    def submit_many(self, prompts, params, request_ids=None, final_only=False):
        return self.inner.submit_many(prompts, params, request_ids, final_only)

    def poll(self, request_ids, timeout_s, finished_only=True):
        outs = self.inner.poll(request_ids, timeout_s, finished_only)
        return [dataclasses.replace(o, error="all raysample workers are gone", retryable=True)
                if o.request_id in self.failing else o for o in outs]


@pytest.mark.parametrize("fmt", ["generate", "run-batch"])
def test_engine_failures_are_retried_by_the_next_run(config, backend, tmp_path, fmt):
    source = tmp_path / "in.jsonl"
    if fmt == "generate":
        source.write_text("".join(json.dumps(unseeded(i)) + "\n" for i in range(4)))
        line_format, key, failing = GenerateFormat(config), "id", {"job:u1", "job:u2"}
    else:
        source.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                              "body": {"prompt": f"p{i}", "max_tokens": 3}}) + "\n" for i in range(4)))
        line_format, key, failing = OpenAIBatchFormat(config), "custom_id", {"job:c1", "job:c2"}
    output = tmp_path / "out.jsonl"
    first = run_job(config, FlakyBackend(backend, failing), source, output, 4, line_format=line_format)
    assert first.errors == 2 and first.done == 2
    failed = [r for r in records(output) if r.get("error")]
    assert all(r.get("retryable") for r in failed)
    if fmt == "run-batch":
        assert all(r["response"]["status_code"] == 500 for r in failed)
    second = run_job(config, backend, source, output, 4, line_format=line_format)
    assert second.done == 2 and second.skipped == 2 and second.errors == 0
    ok = {r[key] for r in records(output) if r.get("error") is None}
    assert len(ok) == 4


class StoppingBackend(FlakyBackend):
    """Stops as the Ray engine does when its last worker dies, at the first results: every pending request
    fails (retryable) and every later submit is refused, whichever of the two the job meets first."""

    def __init__(self, inner: LocalEngine) -> None:
        super().__init__(inner, set())
        self.stopped = False

    def submit_many(self, prompts, params, request_ids=None, final_only=False):
        if self.stopped:
            raise RuntimeError("all raysample workers are gone; pending requests cannot be served")
        return super().submit_many(prompts, params, request_ids, final_only)

    def poll(self, request_ids, timeout_s, finished_only=True):
        if self.stopped:
            return super().poll(request_ids, timeout_s, finished_only)
        outs = super().poll(request_ids, timeout_s, finished_only)
        if outs:
            self.stopped = True
            self.inner.core.publish(self.inner.coordinator.fail_all("all raysample workers are gone"))
        return outs


def test_a_submit_refused_by_a_stopped_engine_still_writes_what_was_running(config, backend, tmp_path):
    """The race a Ray test met: the job's next submit, not its next poll, was the first to see the engine stop."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": f"stop {i}", "sampling_params":
                                          {"max_tokens": 2 if i == 0 else 40, "ignore_eos": True}}) + "\n"
                              for i in range(10)))
    output = tmp_path / "out.jsonl"
    engine = LocalEngine(config)
    with pytest.raises(RuntimeError, match="all raysample workers are gone"):
        run_job(config, StoppingBackend(engine), source, output, max_in_flight=4)
    first = records(output)
    done, failed = [r for r in first if r["error"] is None], [r for r in first if r["error"]]
    # The short line finished; the three still running were written as failed and retryable; the six lines
    # never submitted have no record.
    assert [r["id"] for r in done] == [0] and sorted(r["id"] for r in failed) == [1, 2, 3]
    assert all(r["retryable"] and "workers are gone" in r["error"] for r in failed)
    engine.shutdown()
    second = run_job(config, backend, source, output, max_in_flight=4)
    assert second.skipped == 1 and second.done == 9 and second.errors == 0


def test_a_second_writer_of_the_same_output_fails_at_once(tmp_path):
    output = tmp_path / "out.jsonl"
    held = lock_output(output)
    try:
        with pytest.raises(OutputLocked, match="being written by another raysample job"):
            lock_output(output)
        source = tmp_path / "in.jsonl"
        source.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n")
        cli = subprocess.run([sys.executable, "-m", "cluster.entrypoints.job", "generate", "--config", "configs/default.yaml",
                              "--input", str(source), "--output", str(output), "--local"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert cli.returncode == 2 and "being written by another raysample job" in cli.stderr
        assert "starting" not in cli.stdout  # refused before any engine starts
    finally:
        held.close()
    bad = subprocess.run([sys.executable, "-m", "cluster.entrypoints.job", "generate", "--config", "configs/default.yaml",
                          "--input", "x", "--output", str(output), "--max-in-flight", "-1"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr

"""A real `ray job submit`: start a local head, submit the batch job with --working-dir, check its output."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def ray_head():
    port, dashboard = free_port(), free_port()
    # A private loopback cluster for this test: no token auth, no inherited address.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    start = subprocess.run(
        [RAY, "start", "--head", f"--port={port}", f"--dashboard-port={dashboard}", "--num-cpus=4",
         "--include-dashboard=true", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=env)


def test_ray_job_submit_runs_the_batch_job(ray_head, tmp_path):
    address, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"id": i, "prompt": f"job request {i}", "sampling_params": {"seed": i, "max_tokens": 6}}) + "\n"
        for i in range(6)
    ) + json.dumps({"id": "target", "prompt": "x", "extra_args": {"target_token": 9},
                    "sampling_params": {"max_tokens": 3}}) + "\n")
    output = tmp_path / "results.jsonl"
    submit = subprocess.run(
        [RAY, "job", "submit", f"--address={address}", "--working-dir", str(ROOT), "--",
         sys.executable, "-m", "cluster.job", "generate", "--config", "configs/default.yaml",
         "--input", str(prompts), "--output", str(output)],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT,
    )
    log = submit.stdout[-4000:] + submit.stderr[-4000:]
    assert submit.returncode == 0, log
    assert "succeeded" in log.lower()
    full = submit.stdout + submit.stderr
    assert "Loading weights" not in full and "Tearing down compiled DAG" not in full  # quiet worker logs
    records = {str(r["id"]): r for r in map(json.loads, output.read_text().splitlines())}
    assert set(records) == {*map(str, range(6)), "target"}
    assert all(len(records[str(i)]["token_ids"]) == 6 and records[str(i)]["error"] is None for i in range(6))
    assert records["target"]["token_ids"] == [9, 9, 9]


def test_address_local_starts_a_private_instance_while_another_cluster_runs(ray_head, tmp_path):
    """`ray start --head` is running on this host: `address: local` must not join it."""
    _, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": 1, "prompt": "private", "sampling_params": {"seed": 1, "max_tokens": 4}}) + "\n")
    output = tmp_path / "out.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "cluster.job", "generate", "--config", "configs/default.yaml", "--input", str(prompts),
         "--output", str(output)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(json.loads(output.read_text())["token_ids"]) == 4

"""A job that cannot run fails on the driver in seconds, with one line, before Ray starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_job_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("change", "local", "message"), [
    ({"processors": ["no_such_pkg.mod:Proc"]}, False, "processors: Logits processor 'no_such_pkg.mod:Proc'"),
    ({"processors": [{"class": "nope.zoo:Thing", "request_level": True, "enable_with": "x"}]}, False,
     "request-level 'nope.zoo:Thing' cannot be imported"),
    ({"model": {"path": "/no/such/model/dir", "max_model_len": 64}}, False, "is not a directory"),
    ({"cluster": {"num_workers": 2, "gpus_per_worker": 1}}, False, "this host (address: local) sees 0"),
    ({"cluster": {"num_workers": 1, "gpus_per_worker": 1}}, True, "this process (--local) sees 0"),
])
def test_bad_jobs_fail_fast_with_one_line(tmp_path, change, local, message):
    if torch.cuda.is_available() and "gpus_per_worker" in str(change):
        pytest.skip("this host has a GPU: the GPU check passes here")
    config = tiny_job_config()
    for key, value in change.items():
        config[key] = value if key == "processors" else {**config.get(key, {}), **value}
    if "path" in config["model"]:
        config["model"].pop("tiny", None)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "cluster.entrypoints.job", "generate", "--config", str(tmp_path / "c.yaml"),
                           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                           *(["--local"] if local else [])], capture_output=True, text=True, timeout=120, cwd=ROOT)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert elapsed < 10, elapsed
    assert not (tmp_path / "out.jsonl").exists()

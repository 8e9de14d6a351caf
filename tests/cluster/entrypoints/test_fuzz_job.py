"""Random mixtures of good and bad lines through the job's command line (--local): bad lines touch no good one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fuzz_lines
import pytest
import yaml

pytest.importorskip("logits_processor_zoo", reason="the optional 'zoo' extra is not installed")
ROOT = Path(__file__).resolve().parents[3]


def run(config: Path, source: Path, output: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "cluster.entrypoints.job", "generate", "--config", str(config), "--input",
                           str(source), "--output", str(output), "--local"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_mixtures_in_process(tmp_path, seed):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(fuzz_lines.config(workers=2)))
    lines, goods = fuzz_lines.mixture(seed, good=14, bad=12)
    mixed = run(config, fuzz_lines.write(tmp_path / "mixed.jsonl", lines), tmp_path / "mixed-out.jsonl")
    assert mixed.returncode == 0, mixed.stderr[-3000:]
    clean = run(config, fuzz_lines.write(tmp_path / "clean.jsonl", [json.dumps(g).encode() for g in goods]),
                tmp_path / "clean-out.jsonl")
    assert clean.returncode == 0, clean.stderr[-3000:]
    fuzz_lines.check(tmp_path / "mixed-out.jsonl", tmp_path / "clean-out.jsonl", lines, goods)

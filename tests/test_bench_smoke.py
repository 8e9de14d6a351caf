"""Benchmarks that CI runs as smoke tests: they start, measure and print, with no timing asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_scale_out_quick_runs_simulated_workers_on_ray():
    done = subprocess.run([sys.executable, "bench/scale_out.py", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"^\s*(\d+) workers:\s+(\d+) tokens .* of linear", done.stdout, re.M)
    assert [(int(w), int(t)) for w, t in lines] == [(1, 128), (2, 256)], done.stdout

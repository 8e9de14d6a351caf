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
    runs = re.findall(r"^(\d+) x\s+(\d+), actor calls: (\d+) tokens .* tokens/s \(own core \d+\)$", done.stdout, re.M)
    assert [tuple(map(int, r)) for r in runs] == [(1, 1, 128), (2, 1, 256)], done.stdout
    fractions = re.findall(r"^\d+ x\s+\d+, actor calls\s+\d+\s+([\d.]+)%\s+([\d.]+)%$", done.stdout, re.M)
    assert len(fractions) == 2 and fractions[0] == ("100.0", "100.0"), done.stdout
    assert "own-core step" in done.stdout and "stragglers" in done.stdout

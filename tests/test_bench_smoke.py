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
    runs = re.findall(r"^(\d+) x\s+(\d+), actor calls, (sync|pipelined): (\d+) tokens .* tokens/s \(own core \d+\)$",
                      done.stdout, re.M)
    assert runs == [("1", "1", "sync", "128"), ("1", "1", "pipelined", "128"), ("2", "1", "sync", "256"),
                    ("2", "1", "pipelined", "256")], done.stdout
    fractions = re.findall(r"^(\d+) x\s+\d+, actor calls, \w+\s+\d+\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)%$",
                           done.stdout, re.M)
    assert len(fractions) == 4 and fractions[0][1:3] == fractions[1][1:3] == ("100.0", "100.0"), done.stdout
    assert "own-core step" in done.stdout and "of it ahead" in done.stdout and "stragglers" in done.stdout

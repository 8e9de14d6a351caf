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


def test_cpu_ops_bench_times_the_linears_and_finds_prefetch_and_native_ops_exact_on_the_real_model():
    done = subprocess.run([sys.executable, "bench/cpu_ops.py", "--rows", "2", "--position", "8", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    timings = re.findall(r"^  (inside the model|back to back|weights hot) +[\d.]+ ms +\d+ GFLOP/s$", done.stdout, re.M)
    assert timings == ["inside the model", "back to back", "weights hot"], done.stdout
    assert "logits identical: False" not in done.stdout, done.stdout
    prefetch = re.findall(r"^  (prefetching|not prefetching) +forward +[\d.]+ ms, attention kernel +[\d.]+ ms",
                          done.stdout, re.M)
    assert prefetch == ["prefetching", "not prefetching"] or "kernel is not used here" in done.stdout, done.stdout
    sections = bool(prefetch) + ("not built here" not in done.stdout)  # each compares logits
    assert done.stdout.count("logits identical: True") == sections, done.stdout

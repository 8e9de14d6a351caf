"""Benchmarks that CI runs as smoke tests: they start, measure and print, with no timing asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.ray
def test_scale_out_quick_runs_simulated_workers_on_ray():
    done = subprocess.run([sys.executable, "bench/scale_out.py", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = re.findall(r"^(\d+) x\s+(\d+), actor calls, (sync|pipelined): (\d+) tokens .* tokens/s \(own core \d+\)$",
                      done.stdout, re.M)
    assert runs == [("1", "1", "sync", "128"), ("1", "1", "pipelined", "128"), ("2", "1", "pipelined", "256")], done.stdout
    fractions = re.findall(r"^(\d+) x\s+\d+, actor calls, \w+\s+\d+\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)%$",
                           done.stdout, re.M)
    assert len(fractions) == 3 and fractions[0][1:3] == fractions[1][1:3] == ("100.0", "100.0"), done.stdout
    assert "own-core step" in done.stdout and "of it ahead" in done.stdout and "stragglers" in done.stdout


def run_cpu_ops(env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "bench/cpu_ops.py", "--rows", "2", "--position", "8", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    timings = re.findall(r"^  (inside the model|back to back|weights hot) +[\d.]+ ms +\d+ GFLOP/s$", done.stdout, re.M)
    assert timings == ["inside the model", "back to back", "weights hot"], done.stdout
    assert "logits identical: False" not in done.stdout, done.stdout
    floor = re.search(r"^memory floor: (\d+) MB of weights \+ \d+ MB of K/V at [\d.]+ GB/s \(read, measured now\) = "
                      r"[\d.]+ ms\n  the step: median [\d.]+ ms \(min [\d.]+\) = ([\d.]+)x its floor$", done.stdout, re.M)
    assert floor and 100 < int(floor[1]) < 1000 and float(floor[2]) > 0, done.stdout  # the real model's linears: 135M+ parameters
    compute = re.search(r"^compute floor: the linears' [\d.]+ GFLOP at this CPU's torch\.\w+ matmul peak, (\d+) GFLOP/s "
                        r"\(1024\^3, measured now\) = [\d.]+ ms; the step is ([\d.]+)x the larger floor$", done.stdout, re.M)
    assert compute and int(compute[1]) > 0 and float(compute[2]) > 0, done.stdout
    return done


def host_has_avx512() -> bool:
    return "avx512f" in Path("/proc/cpuinfo").read_text()


@pytest.fixture(scope="module")
def run_as_an_avx2_cpu(tmp_path_factory) -> subprocess.CompletedProcess:
    """The bench as a CPU without AVX-512 runs it: torch's kernels at AVX2, oneDNN capped at AVX2 (so no
    native bfloat16: the runner leaves the linears unprepacked and unfused) and the native kernels built
    for x86-64-v3 into a folder of their own."""
    if " avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("runs as an AVX2 CPU would: this CPU has no AVX2 to run it with")
    kernels = tmp_path_factory.mktemp("kernels")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "RAYSAMPLE_KERNEL_MARCH": "x86-64-v3", "RAYSAMPLE_KERNEL_DIR": str(kernels)}
    done = run_cpu_ops(env)
    done.kernels = kernels
    return done


def test_cpu_ops_bench_times_the_linears_and_finds_prefetch_and_native_ops_exact_on_the_real_model(request):
    # On a CPU without AVX-512 the capped run below is this CPU's own run (the same kernels, the same
    # lines): it serves both tests rather than running the bench twice.
    done = run_cpu_ops() if host_has_avx512() else request.getfixturevalue("run_as_an_avx2_cpu")
    prefetch = re.findall(r"^  (prefetching|not prefetching) +forward +[\d.]+ ms, attention kernel +[\d.]+ ms",
                          done.stdout, re.M)
    assert prefetch == ["prefetching", "not prefetching"] or "kernel is not used here" in done.stdout, done.stdout
    sections = bool(prefetch) + ("not built here" not in done.stdout)  # each compares logits
    assert done.stdout.count("logits identical: True") == sections, done.stdout


def test_cpu_ops_bench_runs_as_on_a_cpu_without_avx512(run_as_an_avx2_cpu):
    """Such a CPU once failed here, dividing by the time of no prepacked linears."""
    done = run_as_an_avx2_cpu
    assert "CPU capability AVX2" in done.stdout, done.stdout
    assert re.search(r"^\d+ linear layers a step \(torch's nn.Linear, not prepacked", done.stdout, re.M), done.stdout
    assert sorted(p.name.split("-")[0] for p in done.kernels.glob("*.so")) == ["exact_ops", "paged_decode"]


def test_e2e_labels_bfloat16_by_what_onednn_runs_not_only_the_cpu_flags():
    """Capped at AVX2 (as on a CPU without AVX-512, or emulating one), bfloat16 is emulated whatever
    /proc/cpuinfo lists, and the bench's header says so."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", "import e2e; print(e2e.cpu_flags())"], cwd=ROOT / "bench",
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("bfloat16 emulated"), done.stdout


def test_row_padding_counts_the_rows_the_ladders_compute_for_the_engines_own_schedule():
    """Deterministic: the same steps cost no more rows with the multiples-of-8 ladder than with the halvings
    (its sizes include theirs), and no fewer than the steps hold."""
    import re

    done = subprocess.run([sys.executable, "bench/row_padding.py", "--requests", "64"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.findall(r"^(.+?) ladder (.+?)\s*: +(\d+) steps, (\d+) rows, computed (\d+)", done.stdout, re.M)
    assert len(found) == 9, done.stdout
    by_alignment: dict[str, dict[str, int]] = {}
    for alignment, ladder, _, real, computed in found:
        assert int(computed) >= int(real) > 0
        by_alignment.setdefault(alignment.strip(), {})[ladder] = int(computed)
    for computed in by_alignment.values():
        assert computed["multiples of 8 (now)"] <= computed["halvings 8-32 (before)"] <= computed["the tile alone"]

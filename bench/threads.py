"""Threads per layout: the e2e workload (greedy) on the in-process engine and on Ray worker layouts.

Layouts: in-process with 1 thread and with every usable core (the default), and on a
private Ray instance 1 worker x all cores, 1 worker x 1 core (the coordinator's process
has the others) and N workers x 1 core (each worker's intra-op
threads follow its ``cpus_per_worker``). Reference: the in-process engine's default,
measured in the same run; prints tokens/s and the ratio for each layout.

    python bench/threads.py [--requests 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import run_raysample, sampling_kwargs, workload  # noqa: E402

from processors import SamplingParams  # noqa: E402
from workers.model.tiny import ensure_tiny_model  # noqa: E402
from workers.step.threads import set_cpu_threads, usable_cores  # noqa: E402


def run_ray(model_dir: Path, jobs, workers: int, cpus: float) -> float:
    from cluster import Engine

    engine = Engine.from_config({"model": {"path": str(model_dir), "dtype": "float32", "max_model_len": 256},
                                 "cluster": {"num_workers": workers, "cpus_per_worker": cpus},
                                 "scheduler": {"max_num_seqs": 64}})
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        params = [SamplingParams(max_tokens=m, ignore_eos=True, **sampling_kwargs("greedy")) for _, m in jobs]
        start = time.perf_counter()
        outs = engine.generate([p for p, _ in jobs], params)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    args = parser.parse_args()
    model_dir = ensure_tiny_model("bench")
    jobs = workload(args.requests, 8192)
    cores = usable_cores()
    results = {}
    for threads in (cores, 1):
        # The in-process engine takes every usable core unless OMP_NUM_THREADS says otherwise.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        set_cpu_threads(threads)  # here and on the compute thread, which runs the engine's model
        tokens, seconds = run_raysample(model_dir, jobs, "greedy", 0, "float32")
        results[f"in-process, {threads} thread(s)"] = tokens / seconds
    del os.environ["OMP_NUM_THREADS"]
    set_cpu_threads(cores)
    results[f"Ray, 1 worker x {cores} CPU"] = run_ray(model_dir, jobs, 1, float(cores))
    if cores > 1:  # the coordinator's process keeps a core of its own
        results["Ray, 1 worker x 1 CPU"] = run_ray(model_dir, jobs, 1, 1.0)
    results[f"Ray, {cores} workers x 1 CPU"] = run_ray(model_dir, jobs, cores, 1.0)
    reference = results[f"in-process, {cores} thread(s)"]
    for name, rate in results.items():
        print(f"{name:<28} {rate:7.0f} tokens/s  {rate / reference:.2f}x the in-process default")


if __name__ == "__main__":
    main()

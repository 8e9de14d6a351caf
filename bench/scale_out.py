"""Throughput of one engine as its (simulated GPU) workers grow: tokens/s against ideal linear scaling.

Each worker is a Ray actor with ``model.simulate`` (default preset ``llama-8b-h100``: it sleeps
the modelled step time of an 8B model on one H100 and returns hash logits on the tiny model's
vocabulary, through the real sampler). Every run gives each worker the same load
(``--rows`` rows of seeded random requests, ``--max-tokens`` tokens each, ignore_eos), so
ideal scaling is the one-worker rate times the workers. Prints tokens/s and the fraction of
ideal for each count, as measured on this machine: here every worker's own host work
(applying the plan, sampling its rows) shares the machine's cores, which a GPU node with a
core per GPU does not.

    python bench/scale_out.py [--workers 1,2,4,8,16] [--rows 64] [--max-tokens 64] [--quick]

Not measured yet (issue 27): the own-core figure, k engines x W workers, and the PNG.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from cluster import Engine  # noqa: E402
from processors import SamplingParams  # noqa: E402


def run(workers: int, rows: int, max_tokens: int, preset: str) -> tuple[int, float, dict]:
    config = {
        "model": {"tiny": "default", "max_model_len": 256, "simulate": {"preset": preset}},
        "cluster": {"num_workers": workers, "cpus_per_worker": 1, "coordinator_name": f"scale-{workers}"},
        "scheduler": {"max_num_seqs": rows * workers, "max_num_batched_tokens": 64 * rows * workers},
    }
    engine = Engine.from_config(config)
    try:
        engine.generate(["warm up"] * workers, SamplingParams(max_tokens=4))
        n = 2 * rows * workers
        prompts = [f"request {i} of the scaling run" for i in range(n)]
        params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True)
                  for i in range(n)]
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        stats = engine.stats()
    finally:
        engine.shutdown()
    return sum(len(o.token_ids) for o in outs), seconds, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8,16")
    parser.add_argument("--rows", type=int, default=64, help="rows per worker")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--preset", default="llama-8b-h100")
    parser.add_argument("--quick", action="store_true", help="1 and 2 workers, 8 rows, 8 tokens (a smoke run)")
    args = parser.parse_args()
    counts = [1, 2] if args.quick else [int(w) for w in args.workers.split(",")]
    rows, max_tokens = (8, 8) if args.quick else (args.rows, args.max_tokens)
    ray.init(num_cpus=max(counts) + 2, include_dashboard=False, namespace="raysample", log_to_driver=False)
    print(f"simulated {args.preset} workers, {rows} rows each, {max_tokens} tokens a request, "
          f"{2 * rows} requests per worker; one engine, plain actor calls")
    base = None
    try:
        for workers in counts:
            tokens, seconds, stats = run(workers, rows, max_tokens, args.preset)
            rate = tokens / seconds
            base = base or rate
            print(f"{workers:>3} workers: {tokens:>7} tokens in {seconds:6.1f} s = {rate:8.0f} tokens/s; "
                  f"{rate / (base * workers):6.1%} of linear; step overhead (median) "
                  f"{stats.get('step_overhead_ms_median') or float('nan'):.2f} ms", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

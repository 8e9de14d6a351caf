"""Prefix caching: a batch whose requests share a long system prompt, with caching on vs off.

Workload: 256 requests = one 512-token system prompt + 16..64 tokens of their
own, 16 generated tokens each (seeded random sampling), on the "bench" tiny
model (hidden 512, 4 layers) in one in-process engine (max_num_seqs 64, one
worker). With prefix caching the system prompt's blocks are computed once and
shared; without it every request prefills it. Prints tokens/s (prompt +
generated tokens processed per second) and the prefill tokens computed for
both, and the ratio.

    python bench/prefix.py [--requests 256] [--system 512] [--workers 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.engine.local_engine import LocalEngine  # noqa: E402
from processors import SamplingParams  # noqa: E402
from workers.model.tiny import ensure_tiny_model  # noqa: E402


def workload(n: int, system_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(10, 8192) for _ in range(system_len)]
    return [system + [rng.randrange(10, 8192) for _ in range(rng.randint(16, 64))] for _ in range(n)]


def run(prompts: list[list[int]], caching: bool, workers: int) -> tuple[float, int, int]:
    engine = LocalEngine({
        "model": {"path": str(ensure_tiny_model("bench")), "dtype": "float32", "max_model_len": 1024},
        "cluster": {"num_workers": workers},
        "scheduler": {"max_num_seqs": 64},
        "cache": {"enable_prefix_caching": caching},
    })
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    before = engine.coordinator.metrics.prefill_tokens
    params = [SamplingParams(max_tokens=16, ignore_eos=True, seed=i) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    processed = sum(len(p) for p in prompts) + sum(len(o.token_ids) for o in outputs)
    return elapsed, processed, engine.coordinator.metrics.prefill_tokens - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--system", type=int, default=512)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    prompts = workload(args.requests, args.system)
    print(f"{args.requests} requests, system prompt {args.system} tokens, "
          f"{sum(len(p) for p in prompts)} prompt tokens in all, {args.workers} worker(s)")
    results = {}
    for caching in (True, False):
        elapsed, processed, prefill = run(prompts, caching, args.workers)
        results[caching] = processed / elapsed
        print(f"prefix caching {'on ' if caching else 'off'}: {processed / elapsed:8.0f} tokens/s "
              f"({elapsed:6.1f} s), prefill tokens computed {prefill}")
    print(f"ratio on / off: {results[True] / results[False]:.2f}x")


if __name__ == "__main__":
    main()

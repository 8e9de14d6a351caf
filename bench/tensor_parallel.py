"""Tensor-parallel groups on this machine: memory per rank and tokens/s against one rank.

For each size, one engine on a private Ray instance with one worker of that many ranks (gloo on
CPU; one CPU share per rank), a fixed KV budget per rank: prints each rank's weight shard and KV
cache (``stats()["rank_memory"]``, measured from the loaded tensors), the tokens that cache holds,
each rank's process RSS, and the greedy tokens/s of a small chat workload against size 1 in the
same run, with whether the tokens equal size 1's. On a CPU machine the ranks share its cores, so
the tokens/s say what the all-reduces and the lead's calls cost here, not what GPUs would gain
(``bench/scale_out.py --tp`` models that).

    python bench/tensor_parallel.py [--model bench|smollm2] [--sizes 1,2,4] [--requests 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import ray  # noqa: E402

from cluster import Engine  # noqa: E402
from processors import SamplingParams  # noqa: E402

MiB = 2**20
KV_BUDGET = 64 * MiB


def model_section(name: str) -> dict:
    if name == "smollm2":
        return {"preset": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 512}
    return {"tiny": "bench", "dtype": "float32", "max_model_len": 512}


def measure(name: str, size: int, requests: int) -> dict:
    config = {"model": {**model_section(name), "tensor_parallel_size": size},
              "cluster": {"num_workers": 1, "cpus_per_worker": 1, "coordinator_name": f"tp-bench-{name}-{size}"},
              "cache": {"kv_cache_memory": KV_BUDGET}, "scheduler": {"max_num_seqs": requests}}
    engine = Engine.from_config(config)
    try:
        prompts = [f"Question {i}: what is {i} plus {i + 1}? Answer briefly." for i in range(requests)]
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm up
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        stats = engine.stats()
        pids = ray.get(engine.worker_handles()[0].rank_pids.remote())
        rss = [psutil.Process(pid).memory_info().rss for pid in pids]
    finally:
        engine.shutdown()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"size": size, "ranks": stats["rank_memory"][0], "rss": rss, "rate": tokens / seconds,
            "tokens": [o.token_ids for o in outs], "kv": stats["kv_cache"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bench", "smollm2"), default="bench",
                        help="bench: the tiny bench model (8 heads, 4 KV heads); smollm2: the real model (9 and 3)")
    parser.add_argument("--sizes", default=None, help="default: 1,2,4 (bench), 1,3 (smollm2)")
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1,3" if args.model == "smollm2" else "1,2,4")).split(",")]
    ray.init(address="local", num_cpus=max(sizes) + 2, include_dashboard=False, namespace="raysample", log_to_driver=False)
    print(f"model {args.model}; KV budget {KV_BUDGET // MiB} MiB per rank; {args.requests} greedy requests x 32 tokens")
    print(f"{'TP':>3} {'weights/rank MiB':>17} {'KV/rank MiB':>12} {'RSS/rank MiB':>13} {'tokens/s':>9} "
          f"{'vs TP=1':>8} {'same tokens':>12}")
    results = []
    try:
        for size in sizes:
            r = measure(args.model, size, args.requests)
            results.append(r)
            base = results[0]
            weights = "/".join(f"{w / MiB:.1f}" for w, _ in r["ranks"])
            kv = "/".join(f"{k / MiB:.1f}" for _, k in r["ranks"])
            rss = "/".join(f"{x / MiB:.0f}" for x in r["rss"])
            print(f"{size:>3} {weights:>17} {kv:>12} {rss:>13} {r['rate']:9.0f} {r['rate'] / base['rate']:8.2f} "
                  f"{str(r['tokens'] == base['tokens']):>12}", flush=True)
            print(f"    {r['kv']}", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

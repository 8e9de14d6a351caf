"""KV memory: concurrency under a fixed budget (paged vs one max_model_len slot per sequence),
and peak RSS of long prompts with and without chunked prefill.

1. The e2e workload (256 prompts of 8..64 tokens, 16..128 generated tokens) on
   the "bench" model at its full context (max_model_len 1024) with a 32 MiB KV
   budget per worker and max_num_seqs 256. A slot layout reserves max_model_len
   positions per sequence, so the budget admits budget // (max_model_len x
   bytes per token) sequences; the paged engine admits what the blocks hold.
   Prints the peak number of concurrently running sequences measured for the
   paged engine, the slot layout's figure, and the ratio.
2. 16 prompts of 2048 tokens (a 4k-context variant of the bench model), 4
   generated tokens each, in a fresh process each: max_num_batched_tokens
   large enough to prefill everything in one forward vs 512 per step. Prints
   the peak RSS of both processes and the ratio.

    python bench/memory.py
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.engine.local_engine import LocalEngine  # noqa: E402
from processors import SamplingParams  # noqa: E402
from workers.model.tiny import PRESETS, TinySpec, ensure_tiny_model  # noqa: E402

BUDGET = 32 * 2**20
LONG_MODEL = TinySpec(**{**PRESETS["bench"].__dict__, "max_position_embeddings": 4096})


def bytes_per_token(spec: TinySpec) -> int:
    head_dim = spec.hidden_size // spec.num_attention_heads
    return 2 * spec.num_hidden_layers * spec.num_key_value_heads * head_dim * 4  # K and V, float32


def concurrency() -> None:
    rng = random.Random(0)
    jobs = [([rng.randrange(10, 8192) for _ in range(rng.randint(8, 64))], rng.randint(16, 128)) for _ in range(256)]
    engine = LocalEngine({
        "model": {"path": str(ensure_tiny_model("bench")), "dtype": "float32", "max_model_len": 1024},
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 4096},
        "cache": {"kv_cache_memory": BUDGET, "enable_prefix_caching": False},
    })
    for (prompt, max_tokens), seed in zip(jobs, range(len(jobs))):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed))
    peak, running = 0, []
    while engine.has_unfinished():
        engine.step()
        running.append(engine.coordinator.num_running())
        peak = max(peak, running[-1])
    slots = BUDGET // (1024 * bytes_per_token(PRESETS["bench"]))
    print(f"KV budget {BUDGET >> 20} MiB, max_model_len 1024: slot layout holds {slots} sequences; "
          f"paged engine ran up to {peak} at once, {sum(running) / len(running):.1f} on average over "
          f"{len(running)} steps (preemptions: {engine.coordinator.scheduler.num_preemptions})")
    print(f"ratio paged / slot concurrency: {peak / slots:.1f}x at the peak, "
          f"{sum(running) / len(running) / slots:.1f}x on average")


def long_prompts_child(budget_tokens: int) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 8192) for _ in range(2048)] for _ in range(16)]
    engine = LocalEngine({
        "model": {"path": str(ensure_tiny_model(LONG_MODEL)), "dtype": "float32", "max_model_len": 4096},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": budget_tokens},
        "cache": {"kv_cache_memory": 16 * 2064 * bytes_per_token(LONG_MODEL), "enable_prefix_caching": False},
    })
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": peak / 1024, "before_mib": base / 1024}))


def peak_rss() -> None:
    ensure_tiny_model(LONG_MODEL)
    results = {}
    for name, budget in (("one forward", 16 * 2048), ("chunked, 512 a step", 512)):
        proc = subprocess.run([sys.executable, __file__, "--child", str(budget)], capture_output=True, text=True, check=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[name]
        print(f"16 prompts x 2048 tokens, {name:>20}: peak RSS {r['peak_mib']:7.0f} MiB "
              f"({r['peak_mib'] - r['before_mib']:6.0f} MiB above the loaded engine)")
    whole, chunked = results["one forward"], results["chunked, 512 a step"]
    print(f"ratio peak RSS, one forward / chunked: {whole['peak_mib'] / chunked['peak_mib']:.2f}x "
          "(the chunked run stays at the peak reached while loading when nothing is printed above it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        long_prompts_child(args.child)
        return
    concurrency()
    peak_rss()


if __name__ == "__main__":
    main()

"""A decode step's cost by sampling mode, on a GPU (issue 79; not run by CI).

    python bench/gpu_sampling.py [--shapes smollm2-shape,llama3-8b-shape] [--steps 20]

In-process engine, one GPU, bfloat16, 64 rows decoding (random-weight models of real shapes,
``workers.model.tiny``). Three runs of the same prompts: greedy; seeded random with top-k 50 and top-p 0.95;
and that with a repetition penalty on every row and a JSON-schema grammar on half of them. Each times the
median engine step over ``--steps`` steady decode steps, and counts the sampler's host reads of device
values before the sampled ids (``workers.sample.sync_counter``; 0 is the target). One line per shape, in this
form (a checker reads it):

    sampling step: <shape> rows=64: greedy <ms> ms, seeded top-k/top-p <ms> ms (<r1>x), with penalty+grammar <ms> ms (<r2>x), host syncs <n>, commit <hash>

``--cpu`` runs a small smoke version anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def mode_params(mode: str, i: int, max_tokens: int):
    from processors import SamplingParams

    if mode == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    extra = {}
    if mode == "grammar":
        extra = {"repetition_penalty": 1.1, "structured_outputs": {"json": SCHEMA} if i % 2 else None}
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True,
                          **extra)


def step_ms(engine, prompts: list[list[int]], mode: str, steps: int, device: torch.device) -> tuple[float, int]:
    """Median ms of an engine step over ``steps`` decode steps of every row, and the sampler's host reads."""
    from workers.sample.sampler import Sampler
    from workers.sample.sync_counter import SyncCounter

    ids = engine.submit_many(prompts, [mode_params(mode, i, steps + 40) for i in range(len(prompts))],
                             final_only=True)
    for _ in range(16):  # admission, prefill, grammars compiled: then every row decodes
        engine.step()
    reads = [0]
    sample = Sampler.sample

    def counting(self, logits, rows=None):
        with SyncCounter() as counter:
            pending = sample(self, logits, rows)
        reads[0] += counter.total
        return pending

    Sampler.sample = counting
    times = []
    try:
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    finally:
        Sampler.sample = sample
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3, reads[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2-shape,llama3-8b-shape")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cpu", action="store_true", help="a smoke run on CPU (the tiny model, 8 rows)")
    args = parser.parse_args()
    if not (torch.cuda.is_available() or args.cpu):
        print("no CUDA device here: nothing to measure (run this on a GPU machine, or --cpu for a smoke run)")
        return 0
    import random

    from bench.gpu_floor import commit
    from cluster.engine.local_engine import LocalEngine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = ["default"] if args.cpu else args.shapes.split(",")
    rows = 8 if args.cpu else args.rows
    here = commit()
    for shape in shapes:
        engine = LocalEngine({"model": {"tiny": shape, "dtype": "bfloat16" if device.type == "cuda" else "float32",
                                        "max_model_len": 512 if args.cpu else 1024},
                              "cluster": {"num_workers": 1, "gpus_per_worker": 1 if device.type == "cuda" else 0},
                              "scheduler": {"max_num_seqs": rows}})
        engine.workers[0].sampler.sync_free = True  # as on a GPU, on CPU too
        rng = random.Random(0)
        top = min(5000, engine.workers[0].runner.vocab_size)
        prompts = [[rng.randrange(5, top) for _ in range(32)] for _ in range(rows)]
        greedy, _ = step_ms(engine, prompts, "greedy", args.steps, device)
        seeded, reads = step_ms(engine, prompts, "seeded", args.steps, device)
        grammar, _ = step_ms(engine, prompts, "grammar", args.steps, device)
        print(f"sampling step: {shape} rows={rows}: greedy {greedy:.2f} ms, seeded top-k/top-p {seeded:.2f} ms "
              f"({seeded / greedy:.2f}x), with penalty+grammar {grammar:.2f} ms ({grammar / greedy:.2f}x), "
              f"host syncs {reads}, commit {here}", flush=True)
        engine.shutdown()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The decode step of the models users run against its HBM floor, on a GPU (issue 78; not run by CI).

    python bench/gpu_floor.py [--shapes llama3-8b-shape,qwen2.5-7b-shape,mistral-7b-shape] [--throughput]

Random-weight models of real shapes (``workers.model.tiny``'s ``*-shape`` presets: the weights are built on
the device from a seed, nothing large travels), bfloat16, one GPU, FlexAttention over the paged cache in
CUDA graphs (the default on CUDA). For each shape and point (64 rows at context 1k, 32 rows at 8k, 256 rows
at 1k) it times one decode step (graph replay; and eager, for the ratio), and its floor: the bytes the step
must read (the weights, and every row's K and V) over the bandwidth of a device-to-device copy measured in
the same run. One line per point, in this form (a checker reads it):

    decode floor: <shape> bf16 rows=<n> ctx=<c>: step <ms> ms, HBM floor <ms> ms (<GB/s> GB/s measured), ratio <r>x, commit <hash>

Then the graphs against the variable-shape forward (``StaticDecoder.disagreement``: logits to bfloat16's
rounding; exit 1 where they differ) and, with ``--throughput``, tokens/s at 1000 in / 1000 out beside
TensorRT-LLM's published Llama-3.1-8B FP8 figures. ``--cpu`` runs a small smoke version anywhere.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POINTS = ((64, 1024), (32, 8192), (256, 1024))
TRT_LLM = "TensorRT-LLM Llama-3.1-8B FP8 at 1000 in / 1000 out: 15,220 tokens/s on an H100, 17,744 on an H200"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once), best of 10."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def decode_point(runner, rows: int, ctx: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """(graph step, eager step) seconds for ``rows`` rows decoding at position ``ctx`` - 1; the K/V in the
    blocks are whatever the pool holds (attention's time does not depend on the values)."""
    from workers.row_work import RowWork

    bs = runner.block_size
    per_row = -(-ctx // bs)
    work = [RowWork(list(range(r * per_row, (r + 1) * per_row)), [7], ctx - 1, 1, decode=True) for r in range(rows)]
    graph = timed(lambda: runner.forward(work), device, repeats)
    static, runner.static = runner.static, None
    try:
        eager = timed(lambda: runner.forward(work), device, max(3, repeats // 4))
    finally:
        runner.static = static
    return graph, eager


def throughput(shape: str, device: torch.device, requests: int, dtype: str) -> None:
    import random

    from cluster.engine.local_engine import LocalEngine
    from processors import SamplingParams

    engine = LocalEngine({"model": {"tiny": shape, "dtype": dtype, "max_model_len": 2048},
                          "cluster": {"num_workers": 1, "gpus_per_worker": 1 if device.type == "cuda" else 0},
                          "scheduler": {"max_num_seqs": 256}})
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(1000)] for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4))
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in done)
    print(f"throughput: {shape} {dtype} 1000 in / 1000 out: {tokens / seconds:.0f} tokens/s ({requests} requests, "
          f"{seconds:.1f} s); {TRT_LLM}", flush=True)
    engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama3-8b-shape,qwen2.5-7b-shape,mistral-7b-shape")
    parser.add_argument("--points", default=",".join(f"{r}x{c}" for r, c in POINTS), help="rowsxctx, ...")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--throughput", action="store_true", help="also tokens/s at 1000 in / 1000 out")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--cpu", action="store_true", help="a smoke run on CPU: tiny shapes and points")
    args = parser.parse_args()
    if not (torch.cuda.is_available() or args.cpu):
        print("no CUDA device here: nothing to measure (run this on a GPU machine, or --cpu for a smoke run)")
        return 0
    from workers.model.model_runner import ModelRunner
    from workers.model.tiny import ensure_tiny_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    shapes = ["micro"] if args.cpu and args.shapes == parser.get_default("shapes") else args.shapes.split(",")
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    if args.cpu and args.points == parser.get_default("points"):
        points = [(4, 64), (2, 128)]
    here = commit()
    bandwidth = copy_bandwidth(device, 2048 if device.type == "cuda" else 64)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: device-to-device copy {bandwidth / 1e9:.0f} GB/s, commit {here}",
          flush=True)
    failed = False
    for shape in shapes:
        path = ensure_tiny_model(shape)
        longest = max(c for _, c in points)
        rows = max(r for r, _ in points)
        blocks_needed = sum(-(-c // 16) * r for r, c in points)
        start = time.perf_counter()
        runner = ModelRunner(path, device, dtype, max_model_len=max(longest, 2048) if device.type == "cuda" else longest,
                             max_rows=rows,
                             block_size=16, verify=device.type == "cuda", batch_invariant=False,
                             kv_cache_memory=None if device.type == "cuda" else (blocks_needed + 8) * 1 << 20)
        print(f"{shape}: runner up in {time.perf_counter() - start:.1f} s, {runner.num_blocks} KV blocks, "
              f"{'FlexAttention' if runner.flex else 'torch'} attention, "
              f"{len(runner.static.graphs) if runner.static is not None else 0} CUDA graphs", flush=True)
        problem = runner.static.disagreement() if runner.static is not None else None
        print(f"{shape}: graphs vs the variable-shape forward: {problem or 'the same logits to rounding'}", flush=True)
        failed |= problem is not None
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_per_token = 2 * runner.num_layers * runner.kv_heads * runner.head_dim * torch.empty(
            0, dtype=runner.dtype).element_size()
        for rows, ctx in points:
            if -(-ctx // 16) * rows > runner.num_blocks:
                print(f"{shape}: rows={rows} ctx={ctx} does not fit the KV cache ({runner.num_blocks} blocks)")
                continue
            graph, eager = decode_point(runner, rows, ctx, device, args.repeats)
            floor = (weight_bytes + rows * ctx * kv_per_token) / bandwidth
            label = "bf16" if dtype == "bfloat16" else "fp32"
            print(f"decode floor: {shape} {label} rows={rows} ctx={ctx}: step "
                  f"{graph * 1e3:.2f} ms, HBM floor {floor * 1e3:.2f} ms ({bandwidth / 1e9:.0f} GB/s measured), "
                  f"ratio {graph / floor:.2f}x, commit {here}", flush=True)
            print(f"{shape} rows={rows} ctx={ctx}: eager step {eager * 1e3:.2f} ms ({eager / graph:.2f}x the graph's)",
                  flush=True)
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.throughput:
            throughput(shape, device, args.requests if device.type == "cuda" else 4, dtype)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

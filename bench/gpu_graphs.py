"""The decode step on a GPU, CUDA graphs against eager (not run by CI: it needs CUDA).

    python bench/gpu_graphs.py [--requests 256] [--max-tokens 128] [--model smollm2-shape|smollm2]

In-process engines, one GPU worker, bfloat16, 64 sequences:

1. the tiny random model, ``enforce_eager`` true against unset (graphs): how many of 48 requests keep
   their tokens, greedy and seeded random, float32 and bfloat16;
2. ``--model`` (default: SmolLM2-135M-Instruct's shape with random weights, ``workers.model.tiny``'s
   ``smollm2-shape``, since the real weights are larger than what may travel to a lent GPU; the
   speed of a step does not depend on the weights' values), for eager and for graphs, pipelined
   (the GPU's default) and graphs synchronous:
   - generated tokens/s on ``--requests`` requests of 16..``--max-tokens`` tokens, greedy and
     seeded random, ignore_eos;
   - a profile of 64 rows decoding: the GPU kernels' time against the steps' wall time (timed without
     the profiler, whose hooks slow the host, and with it), and host launches (kernels, graphs,
     copies) per step;
   - greedy agreement with transformers' eager bfloat16 forward by teacher forcing (as bench/gpu_check.py);
3. how many requests kept their tokens, graphs against eager;
4. with ``--ray``: the graphs engine as one Ray GPU worker actor (the default step), tokens/s and
   tokens against the in-process one.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from processors import SamplingParams  # noqa: E402


def engine_config(model: dict, enforce_eager: bool | None, pipelined: bool | None, dtype: str = "bfloat16",
                  kv: str = "4GiB", rows: int = 64) -> dict:
    length = 256 if model.get("tiny") == "default" else 1024
    return {"model": {**model, "dtype": dtype, "max_model_len": length, "enforce_eager": enforce_eager},
            "cache": {"kv_cache_memory": kv},
            "cluster": {"num_workers": 1, "gpus_per_worker": 1 if torch.cuda.is_available() else 0},
            "scheduler": {"max_num_seqs": rows, "async_scheduling": pipelined}}


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def same(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def tiny_check() -> None:
    from cluster.engine.local_engine import LocalEngine

    prompts = [[1 + i, 5, 9, 3 + i, 7] * (1 + i % 5) for i in range(48)]
    for dtype in ("float32", "bfloat16"):
        for kind in ("greedy", "random"):
            params = [SamplingParams(temperature=0.0 if kind == "greedy" else 0.8, seed=i, max_tokens=8 + i % 24)
                      for i in range(48)]
            runs = []
            for eager in (True, None if torch.cuda.is_available() else False):
                engine = LocalEngine(engine_config({"tiny": "default"}, eager, None, dtype, "64MiB", 32))
                runs.append(tokens_of(engine.generate(prompts, params)))
                del engine
            print(f"tiny model {dtype} {kind}: graphs vs eager {same(*runs)} requests token-identical", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_decode(engine, prompts: list[list[int]], steps: int, seeded: bool = False,
                   table: bool = False) -> str:
    """Kernel share of wall time and host launches per step over ``steps`` decode steps of 64 rows
    (greedy, or seeded random with top-p and top-k)."""
    from torch.profiler import ProfilerActivity, profile

    if seeded:
        params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, max_tokens=2 * steps + 24,
                                 ignore_eos=True) for i in range(len(prompts))]
    else:
        params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 24, ignore_eos=True)
    ids = engine.submit_many(prompts, params, final_only=True)
    for _ in range(12):  # admission and prefill, then a few decode steps
        engine.step()
    sync()
    start = time.perf_counter()  # the same steps' wall time without the profiler, whose per-op hooks slow the host
    for _ in range(steps):
        engine.step()
    sync()
    plain = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    engine.results(ids)
    kernel_us = launches = 0
    for event in prof.events():
        kind = str(getattr(event, "device_type", ""))
        if kind.endswith("CUDA") and not event.name.startswith(("Memcpy", "Memset")):
            kernel_us += event.device_time if hasattr(event, "device_time") else event.cuda_time
        if event.name in ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaLaunchKernelExC",
                          "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += 1
    if table:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48),
              flush=True)
    return (f"{plain / steps * 1e3:.2f} ms a step ({wall / steps * 1e3:.2f} ms profiled), GPU kernels "
            f"{kernel_us / 1e3 / steps:.2f} ms a step ({kernel_us / 1e6 / plain:.0%} of the step; "
            f"{kernel_us / 1e6 / wall:.0%} of the profiled one), {launches / steps:.0f} launches a step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2-shape", choices=["smollm2-shape", "smollm2", "tiny"])
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="a smoke run on CPU (graphs: the compiled proof)")
    parser.add_argument("--skip-pipelined", action="store_true", help="leave out graphs with the pipelined step")
    parser.add_argument("--skip-eager", action="store_true", help="leave out the eager engine")
    parser.add_argument("--op-table", action="store_true", help="print the profiled host operators of each profile")
    parser.add_argument("--ray", action="store_true",
                        help="also the same engine (graphs, default step) as a Ray GPU worker actor, against in-process")
    args = parser.parse_args()
    if not (torch.cuda.is_available() or args.cpu):
        print("no CUDA device here: nothing to check (run this on a GPU machine)")
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    graphs = None if device == "cuda" else False  # enforce_eager for the graph runs
    import transformers
    from transformers import AutoModelForCausalLM

    from bench.gpu_check import agreement
    from cluster.config import load_config
    from cluster.engine.local_engine import LocalEngine

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name(0) if device == 'cuda' else 'CPU'}", flush=True)
    if not args.skip_tiny:
        tiny_check()
    model = {"preset": "smollm2-135m-instruct"} if args.model == "smollm2" else {
        "tiny": "default" if args.model == "tiny" else "smollm2-shape"}
    path = load_config(engine_config(model, True, None)).model.resolve_path()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    reference = reference.to(device).eval()
    rng = random.Random(0)
    top = min(reference.config.vocab_size, 5000)
    chats = [[rng.randrange(10, top) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    load = [([rng.randrange(10, top) for _ in range(rng.randint(20, 60))], rng.randint(16, args.max_tokens))
            for _ in range(args.requests)]
    profile_prompts = [[rng.randrange(10, top) for _ in range(32)] for _ in range(64)]
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    modes = [("eager, pipelined", True, True), ("graphs, pipelined", graphs, True), ("graphs, synchronous", graphs, False)]
    if args.skip_pipelined:
        modes.remove(modes[1])
    if args.skip_eager:
        modes.remove(modes[0])
    if args.ray:
        modes.append(("Ray, graphs, default step", graphs, None))
    for name, eager, pipelined in modes:
        start = time.perf_counter()
        if name.startswith("Ray"):
            from cluster import Engine

            engine = Engine.from_config(engine_config(model, eager, pipelined))
            print(f"{name}: engine built in {time.perf_counter() - start:.1f} s", flush=True)
        else:
            engine = LocalEngine(engine_config(model, eager, pipelined))
            runner = engine.workers[0].runner
            captured = len(runner.static.graphs) if runner.static is not None else 0
            print(f"{name}: engine built in {time.perf_counter() - start:.1f} s, {captured} CUDA graphs, "
                  f"{runner.num_blocks} KV blocks", flush=True)
        greedy = engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=32))
        exact, worst = agreement(reference, chats, [o.token_ids for o in greedy])
        print(f"{name}: greedy vs transformers eager bfloat16: argmax at {exact:.1%} of positions, "
              f"largest gap {worst:.3f}", flush=True)
        engine.generate(chats[:2], SamplingParams(max_tokens=4))
        runs = {}
        for kind in ("greedy", "random"):
            params = [SamplingParams(temperature=0.0 if kind == "greedy" else 0.8, top_p=1.0 if kind == "greedy"
                                     else 0.95, top_k=0 if kind == "greedy" else 50, seed=i, max_tokens=m,
                                     ignore_eos=True) for i, (_, m) in enumerate(load)]
            start = time.perf_counter()
            done = engine.generate([p for p, _ in load], params)
            seconds = time.perf_counter() - start
            count = sum(len(o.token_ids) for o in done)
            print(f"{name}, {kind}: {count} tokens in {seconds:.2f} s = {count / seconds:.0f} tokens/s", flush=True)
            runs[kind] = tokens_of(done)
        outputs[name] = runs
        if not name.startswith("Ray"):
            for seeded in (False, True):
                print(f"{name}: profile of 64 rows decoding, {'seeded random' if seeded else 'greedy'}: "
                      f"{profile_decode(engine, profile_prompts, 24, seeded, args.op_table)}", flush=True)
        engine.shutdown()
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, against in (("graphs, pipelined", "eager, pipelined"), ("graphs, synchronous", "eager, pipelined"),
                          ("Ray, graphs, default step", "graphs, synchronous")):
        for kind in ("greedy", "random"):
            if name in outputs and against in outputs:
                print(f"{name} vs {against}, {kind}: {same(outputs[against][kind], outputs[name][kind])} "
                      "requests token-identical", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

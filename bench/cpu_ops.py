"""Where a CPU decode step of the real model goes, and what the exact native ops save.

SmolLM2-135M on CPU (what it measures exists only there), ``--rows`` decode rows at ``--position``:
- **linears**: the step's prepacked linear layers timed inside the model's forward, then the same
  layers back to back on inputs of the same shapes (nothing between them), then each repeated with
  its weights hot in cache; GFLOP/s of each. When the three agree, the linears run at their own
  speed and the rest of the step is the other ops;
- **attention prefetch**: the forward with the decode-attention kernel prefetching each thread's
  next tasks' keys and values, and without (alternating on one runner), the kernel's own time in
  each, and whether the logits are identical;
- **memory floor**: the bytes a decode step must read (every linear's weights once, and each row's
  keys and values up to its position) over the read bandwidth measured in the same run, and the
  step's median time as a multiple of that floor; beside it the **compute floor**, the linears'
  FLOPs at torch's square-matmul peak in the dtype measured in the run (the larger bound where
  bfloat16 has no AMX), and the step against the larger of the two;
- **exact ops**: the forward with and without the native RMSNorm and rotary embedding
  (``workers/cpu/exact_ops.py``): two runners of the same weights, alternating in one process (this
  machine's speed drifts between runs), medians, and whether their logits are identical.

    python bench/cpu_ops.py [--dtype bfloat16] [--position 200] [--rows 64] [--repeats 15] [--random-weights]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import workers.model.paged_attention as paged  # noqa: E402
from workers.cpu import exact_ops  # noqa: E402
from workers.cpu.cpu_linear import PrepackedLinear  # noqa: E402
from workers.model.model_runner import ModelRunner  # noqa: E402
from workers.model.model_source import gguf_to_transformers, preset_gguf  # noqa: E402
from workers.model.tiny import ensure_tiny_model  # noqa: E402
from workers.row_work import RowWork  # noqa: E402


def step_tokens(rows: int, position: int) -> int:
    """The runner's ``max_step_tokens``: the bench's largest step is the prefill of ``rows`` prompts of
    ``position`` tokens (capped at the engine's default, 2048, which the default sizes reach). The
    runner proves its linears row-invariant up to that many rows, once per host: where bfloat16 is
    emulated, proving 2,048 for the smoke run's 16-token steps took some 10 CPU-s."""
    return min(rows * position, 2048)


def decode_rows(runner: ModelRunner, rows: int, position: int) -> list[RowWork]:
    """Prefill ``rows`` prompts of ``position`` tokens, then one decode token each. Each row's blocks
    are scattered over the pool, as an engine's free list leaves them once requests come and go."""
    blocks = (position + 64) // runner.block_size + 1
    ids = torch.randperm(rows * blocks, generator=torch.Generator().manual_seed(0)).view(rows, blocks).tolist()
    prompts = [RowWork(block_table=ids[i], token_ids=list(range(1, position + 1)), start_pos=0) for i in range(rows)]
    runner.forward(prompts)
    return [RowWork(block_table=p.block_table, token_ids=[5], start_pos=position + i % 7, decode=True)
            for i, p in enumerate(prompts)]


def linears(runner: ModelRunner, step: list[RowWork], repeats: int) -> None:
    """Times the model's linears as it has them: prepacked, or torch's ``nn.Linear`` where oneDNN
    has no native kernels for the dtype (bfloat16 on a CPU without AVX-512), which the runner
    leaves unfused."""
    order: list[nn.Module] = []
    layers = [m for m in runner.model.modules() if isinstance(m, (PrepackedLinear, nn.Linear))]
    kind = ("prepacked for oneDNN" if all(isinstance(m, PrepackedLinear) for m in layers)
            else f"torch's nn.Linear, not prepacked: oneDNN has no native {runner.dtype} kernels on this CPU")
    hooks = [m.register_forward_pre_hook(lambda module, *_: order.append(module)) for m in layers]
    runner.forward(step)
    for hook in hooks:
        hook.remove()
    rows = len(step)
    inputs = [torch.randn(rows, m.in_features).to(runner.dtype) for m in order]
    flops = sum(2 * rows * m.in_features * m.out_features for m in order)
    inside: list[float] = []
    started: list[float] = []
    total = [0.0]

    def enter(*_):
        started.append(time.perf_counter())

    def leave(*_):
        total[0] += time.perf_counter() - started.pop()

    timings: dict[str, list[float]] = {"inside the model": inside, "back to back": [], "weights hot": []}
    with torch.inference_mode():
        for _ in range(repeats):
            hooks = [m.register_forward_pre_hook(enter) for m in order] + [m.register_forward_hook(leave) for m in order]
            total[0] = 0.0
            runner.forward(step)
            inside.append(total[0])
            for hook in hooks:
                hook.remove()
            start = time.perf_counter()
            for layer, x in zip(order, inputs):
                layer(x)
            timings["back to back"].append(time.perf_counter() - start)
        for layer, x in zip(order, inputs):
            layer(x)
        for _ in range(max(3, repeats // 3)):
            spent = 0.0
            for layer, x in zip(order, inputs):
                layer(x)  # its weights now in cache
                start = time.perf_counter()
                layer(x)
                spent += time.perf_counter() - start
            timings["weights hot"].append(spent)
    print(f"{len(order)} linear layers a step ({kind}), {flops / 1e9:.1f} GFLOP for {rows} rows:")
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        print(f"  {name:18s} {median * 1e3:7.1f} ms  {flops / median / 1e9:5.0f} GFLOP/s")


def read_bandwidth(repeats: int = 5, size: int = 512 << 20) -> float:
    """Bytes per second of a streaming read of a buffer far larger than the caches (all threads), best of ``repeats``."""
    buffer = torch.ones(size // 4, dtype=torch.float32)
    buffer.sum()  # its pages touched once
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return size / best


def step_bytes(runner: ModelRunner, step: list[RowWork]) -> tuple[int, int]:
    """(weight bytes, K/V bytes) a decode step reads at the least: each linear's weights once (the LM
    head included; the embedding gives only its rows), and each row's keys and values to its position."""
    weights = 0
    for module in runner.model.modules():
        if isinstance(module, PrepackedLinear):
            weights += module.in_features * module.out_features * module.weight_dtype.itemsize
        elif isinstance(module, nn.Linear):
            weights += module.weight.numel() * module.weight.element_size()
    per_token = 2 * runner.num_layers * runner.kv_heads * runner.head_dim * runner.dtype.itemsize
    return weights, sum(row.start_pos + len(row.token_ids) for row in step) * per_token


def matmul_peak(dtype: torch.dtype, size: int = 1024, seconds: float = 1.0) -> float:
    """FLOP/s of torch's square matmul in ``dtype`` (all threads), a second of repeats after a warm-up.

    The warm-up is a quarter second of calls, at least one: where bfloat16 is emulated a call takes
    about 2 s, and the three fixed warm-up calls this once made spent 6 s before the second measured."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    start = time.perf_counter()
    a @ b
    while time.perf_counter() - start < seconds / 4:
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (time.perf_counter() - start)


def linear_flops(runner: ModelRunner, rows: int) -> int:
    layers = [m for m in runner.model.modules() if isinstance(m, (PrepackedLinear, nn.Linear))]
    return sum(2 * rows * m.in_features * m.out_features for m in layers)


def memory_floor(runner: ModelRunner, step: list[RowWork], repeats: int) -> None:
    bandwidth = read_bandwidth()
    weights, kv = step_bytes(runner, step)
    floor = (weights + kv) / bandwidth
    # Where the CPU's matmuls are slow for the dtype (bfloat16 without AMX), the linears' arithmetic bounds the step first.
    peak = matmul_peak(runner.dtype)
    compute = linear_flops(runner, len(step)) / peak
    spent = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(step)
            spent.append(time.perf_counter() - start)
    median = statistics.median(spent)
    print(f"memory floor: {weights / 1e6:.0f} MB of weights + {kv / 1e6:.0f} MB of K/V at {bandwidth / 1e9:.1f} GB/s "
          f"(read, measured now) = {floor * 1e3:.1f} ms")
    print(f"  the step: median {median * 1e3:.1f} ms (min {min(spent) * 1e3:.1f}) = {median / floor:.2f}x its floor")
    print(f"compute floor: the linears' {linear_flops(runner, len(step)) / 1e9:.1f} GFLOP at this CPU's {runner.dtype} "
          f"matmul peak, {peak / 1e9:.0f} GFLOP/s (1024^3, measured now) = {compute * 1e3:.1f} ms; the step is "
          f"{median / max(floor, compute):.2f}x the larger floor")


def attention_prefetch(runner: ModelRunner, step: list[RowWork], repeats: int) -> None:
    kernel = paged.native_paged_decode
    prefetch = [True]
    spent = [0.0]

    def timed(*args, **kwargs):
        start = time.perf_counter()
        kernel(*args, **kwargs, prefetch=prefetch[0])
        spent[0] += time.perf_counter() - start

    names = {True: "prefetching", False: "not prefetching"}
    forward: dict[bool, list[float]] = {True: [], False: []}
    attention: dict[bool, list[float]] = {True: [], False: []}
    logits: dict[bool, torch.Tensor] = {}
    paged.native_paged_decode = timed
    try:
        for _ in range(repeats):
            for on in (True, False):
                prefetch[0], spent[0] = on, 0.0
                start = time.perf_counter()
                logits[on] = runner.forward(step)
                forward[on].append(time.perf_counter() - start)
                attention[on].append(spent[0])
    finally:
        paged.native_paged_decode = kernel
    if not spent[0]:
        print("attention prefetch: the native decode kernel is not used here")
        return
    print(f"decode attention, {len(step)} rows (the kernel inside the forward), alternating:")
    for on in (True, False):
        print(f"  {names[on]:16s} forward {statistics.median(forward[on]) * 1e3:6.1f} ms, "
              f"attention kernel {statistics.median(attention[on]) * 1e3:5.1f} ms (medians)")
    print(f"  logits identical: {torch.equal(logits[True], logits[False])}")


def exact_ops_saving(model_dir: Path, dtype: str, rows: int, position: int, repeats: int) -> None:
    if not exact_ops.available():
        print("exact native ops: not built here (no C++ compiler)")
        return
    available = exact_ops.available
    runners = {"with the native ops": ModelRunner(model_dir, "cpu", dtype=dtype, max_model_len=1024, max_rows=rows,
                                                  max_step_tokens=step_tokens(rows, position), verify=False)}
    exact_ops.available = lambda: False  # the second runner keeps torch's ops
    try:
        runners["torch's ops"] = ModelRunner(model_dir, "cpu", dtype=dtype, max_model_len=1024, max_rows=rows,
                                             max_step_tokens=step_tokens(rows, position), verify=False)
    finally:
        exact_ops.available = available
    steps = {name: decode_rows(runner, rows, position) for name, runner in runners.items()}
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    logits: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            logits[name] = runner.forward(steps[name])
            seconds[name].append(time.perf_counter() - start)
    print(f"a {rows}-row decode forward at position {position}, alternating:")
    for name, spent in seconds.items():
        print(f"  {name:20s} median {statistics.median(spent) * 1e3:6.1f} ms  (min {min(spent) * 1e3:.1f})")
    same = torch.equal(*logits.values())
    print(f"  logits identical: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--position", type=int, default=200)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2-135M's shapes with random weights (model.tiny: smollm2-shape), where the real "
                             "model is not installed (a lent machine): a step's time does not depend on the values")
    args = parser.parse_args()
    if args.random_weights:
        model_dir = ensure_tiny_model("smollm2-shape")
    else:
        model_dir = gguf_to_transformers(preset_gguf("smollm2-135m-instruct"), args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    runner = ModelRunner(model_dir, "cpu", dtype=args.dtype, max_model_len=1024, max_rows=args.rows,
                         max_step_tokens=step_tokens(args.rows, args.position), verify=False)
    step = decode_rows(runner, args.rows, args.position)
    linears(runner, step, args.repeats)
    memory_floor(runner, step, args.repeats)
    attention_prefetch(runner, step, args.repeats)
    del runner
    exact_ops_saving(model_dir, args.dtype, args.rows, args.position, args.repeats)


if __name__ == "__main__":
    main()

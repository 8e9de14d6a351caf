"""Issues 57 and 80's CPU checks on whatever CPU runs this: a linear row's bits at every row count, and seeded requests alone against batched.

The issue's defect was seen on an Intel Xeon with AMX, where oneDNN's bfloat16 kernel changes at 33
rows. None of the 2-core machines here has AMX; the lent GPU machines' hosts are Intel Xeons, which
may. So this needs only torch and transformers (no Ray, no pytest, no model hub) and is meant to run
there as it is (torch's CUDA build runs the same oneDNN kernels on the CPU). The model is
SmolLM2-135M-Instruct's shape with random weights (``model.tiny: smollm2-shape``): which kernel oneDNN
picks depends on the shapes, the dtype and the row count, not on the weights' values. ``--real`` uses
the real model instead, where ``make setup`` has installed it.

For each dtype it prints:

- **the kernels as they are**: each linear shape's row counts M (1 to ``--rows``; the LM head to the
  64 rows a step samples) at which some row's output in a call of M rows differs from the same row in
  a call of all of them: the issue's table, for this CPU;
- **as the runner builds them**: every linear in calls of ``model.cpu_row_tile`` rows
  (``workers/cpu/row_tiles.py``), and the same sweep through the runner's layers, which must find nothing;
- **the engine** (in-process): ``--prompts`` prompts of different lengths in one batch (past 33 rows
  a decode step), seeded random (temperature 0.8, seed 7, as the issue's example) and greedy,
  ``--max-tokens`` each, and the first ``--alone`` of them each alone: tokens and logprobs compared
  bit for bit (equal logprobs mean equal logits); then the same with
  the construction off (``model.batch_invariant: false``), which shows whether this CPU's kernels would
  have changed the tokens without it.

Exits 1 where the runner's sweep or the engine with the construction differs, else 0.

    python bench/amx_check.py [--dtypes bfloat16,float32] [--rows 128] [--prompts 48] [--real]
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from cluster.engine.local_engine import LocalEngine  # noqa: E402
from processors import SamplingParams  # noqa: E402
from workers.cpu.cpu_linear import PrepackedLinear, prepack_available  # noqa: E402
from workers.cpu.row_tiles import kernel_of as own_kernel  # noqa: E402  the layer's matmul without its tiles
from workers.model.model_runner import ModelRunner  # noqa: E402
from workers.model.tiny import ensure_tiny_model  # noqa: E402

SAMPLED_ROWS = 64  # a step's sampled rows (the runner's max_rows): all the LM head ever sees
TOPICS = ["the sea", "a robot", "gravity", "the moon", "bread", "rivers", "chess", "winter"]


def cpu_summary() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = sorted(set(re.findall(r"\b(avx512_bf16|avx512_fp16|amx_\w+)\b", text)))
    return (f"{model[1] if model else platform.processor()}; {', '.join(flags) or 'no avx512_bf16 or amx flag'}; "
            f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads")


def spans(counts: list[int]) -> str:
    """``[1, 2, 3, 33, 48]`` as ``1-3, 33, 48``."""
    runs: list[list[int]] = []
    for m in counts:
        if runs and m == runs[-1][1] + 1:
            runs[-1][1] = m
        else:
            runs.append([m, m])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def changing_counts(compute, x: torch.Tensor) -> list[int]:
    """Row counts M at which some row of a call of M rows differs from that row in a call of all of ``x``."""
    full = compute(x)
    return [m for m in range(1, len(x) + 1) if not torch.equal(compute(x[:m]), full[:m])]


def linear_shapes(runner: ModelRunner) -> dict[tuple[int, int, bool], nn.Module]:
    head = runner.model.get_output_embeddings()
    shapes: dict[tuple[int, int, bool], nn.Module] = {}
    for module in runner.model.modules():
        if isinstance(module, PrepackedLinear) or type(module) is nn.Linear:
            shapes.setdefault((module.in_features, module.out_features, module is head), module)
    return shapes


def sweep_linears(model_path: Path, dtype: str, rows: int) -> bool:
    """The kernels as they are, then as the runner runs them; True where the runner's layers are invariant."""
    start = time.perf_counter()
    runner = ModelRunner(model_path, "cpu", dtype, max_model_len=256, max_rows=SAMPLED_ROWS,
                         max_step_tokens=2 * rows, verify=False)
    prepacked = prepack_available(torch.device("cpu"), runner.dtype)
    tiles = sorted({getattr(m, "row_tile", None) for m in runner.model.modules() if own_kernel(m) is not None} - {None})
    print(f"  linears: {'oneDNN prepacked' if prepacked else 'torch matmul (no native oneDNN kernels)'}; "
          f"rows per call: {tiles} (runner built in {time.perf_counter() - start:.1f} s)")
    generator = torch.Generator().manual_seed(3)
    invariant = True
    with torch.inference_mode():
        for (width, out, is_head), module in linear_shapes(runner).items():
            count = SAMPLED_ROWS if is_head else rows
            x = (torch.randn(count, width, generator=generator) * 3).to(runner.dtype)
            start = time.perf_counter()
            raw = changing_counts(own_kernel(module), x)
            built = changing_counts(module, x)
            invariant &= not built
            print(f"  {width:>5} x {out:<6}{' (LM head)' if is_head else '          '} M 1-{count}: the kernel as it is "
                  f"changes at {spans(raw)}; as the runner runs it: {spans(built)} "
                  f"({time.perf_counter() - start:.1f} s)")
    return invariant


def record(output) -> tuple:
    """A request's tokens and each one's logprob: equal logprobs mean equal logits, bit for bit."""
    return tuple(output.token_ids), tuple(tuple(step.items()) for step in output.outputs[0].logprobs)


def alone_and_batched(config: dict, prompts: list[str], params: SamplingParams, alone: int) -> tuple[int, int]:
    """(of the first ``alone`` requests, those whose tokens and logprobs alone equal theirs in a batch of all, ``alone``)."""
    engine = LocalEngine(config)
    try:
        batched = [record(o) for o in engine.generate(prompts, [params] * len(prompts))]
        by_itself = [record(engine.generate(p, params)[0]) for p in prompts[:alone]]
    finally:
        engine.shutdown()
    return sum(a == b for a, b in zip(by_itself, batched)), len(by_itself)


def engine_checks(model: dict, dtype: str, prompts: list[str], max_tokens: int, alone: int) -> bool:
    config = {"model": {**model, "dtype": dtype, "max_model_len": 512}, "scheduler": {"max_num_seqs": SAMPLED_ROWS}}
    samplings = {"seeded random": SamplingParams(temperature=0.8, seed=7, max_tokens=max_tokens, ignore_eos=True,
                                                 logprobs=0),
                 "greedy": SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)}
    exact = True
    off = {**config, "model": {**config["model"], "batch_invariant": False}}
    for label, params in samplings.items():
        start = time.perf_counter()
        same, total = alone_and_batched(config, prompts, params, alone)
        exact &= same == total
        unfixed, _ = alone_and_batched(off, prompts, params, alone)
        print(f"  engine, {label}: {same}/{total} requests alone give their tokens and logprobs in the batch of "
              f"{len(prompts)} "
              f"({unfixed}/{total} with the construction off; {time.perf_counter() - start:.0f} s)")
    return exact


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", type=int, default=128, help="row counts swept for the linears inside the model")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--alone", type=int, default=12, help="of them, how many are also run alone (the first)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--real", action="store_true", help="the real SmolLM2-135M-Instruct (make setup) instead of "
                                                            "random weights of its shapes")
    args = parser.parse_args()
    print(cpu_summary())
    if args.real:
        from cluster.config import resolve

        model_path = Path(resolve({"model": {"preset": "smollm2-135m-instruct"}}).facts.path)
        model = {"preset": "smollm2-135m-instruct"}
    else:
        model_path, model = ensure_tiny_model("smollm2-shape"), {"tiny": "smollm2-shape"}
    prompts = [f"Tell me about {TOPICS[i % len(TOPICS)]}." + " Please be brief." * (i % 5) for i in range(args.prompts)]
    ok = True
    for dtype in args.dtypes.split(","):
        print(f"{dtype}, {'the real model' if args.real else 'SmolLM2-135M shapes, random weights'}:")
        ok &= sweep_linears(model_path, dtype, args.rows)
        ok &= engine_checks(model, dtype, prompts, args.max_tokens, args.alone)
    print("every check exact" if ok else "SOME CHECK DIFFERS: a row's output depends on its batch on this CPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

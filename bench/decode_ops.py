"""How many torch operators one decode layer dispatches on the GPU's path, counted on this CPU.

    python bench/decode_ops.py [--rows 16] [--dtype float32] [--tiny]

On a GPU each top-level operator is at least one kernel launch, and a launch costs the host
about 6 us (bench/RESULTS.md, "On a GPU"), so this count is what an eager GPU decode step
pays per layer. The runner is built as on a GPU: decode attention in torch, no CPU weight
prepacking, no native CPU ops. One decode step of ``--rows`` rows at position ~100 of the real
model (SmolLM2-135M-Instruct; ``--tiny``: the tiny test model) is profiled with torch's
profiler, and the greedy sampler's operators on its logits are added (spread over the layers,
as a GPU profile of a step shows them). Printed for the variable-shape forward
(``enforce_eager``) and for the fixed-shape forward that CUDA graphs capture; and, per layer,
which operators they are.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch  # noqa: E402
from processors import EngineConfig, SamplingParams  # noqa: E402
from workers.model.model_runner import ModelRunner  # noqa: E402
from workers.row_work import RowWork  # noqa: E402
from workers.sample.sampler import Sampler  # noqa: E402


def top_level_ops(fn) -> Counter:
    """Names of the aten operators ``fn`` dispatches that no other aten operator called."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: Counter = Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            counts[event.name] += 1
    return counts


def model_path(tiny: bool, dtype: str) -> str:
    if tiny:
        from workers.model.tiny import ensure_tiny_model

        return str(ensure_tiny_model("default"))
    from workers.model.model_source import gguf_to_transformers, preset_gguf

    return str(gguf_to_transformers(preset_gguf("smollm2-135m-instruct"), dtype))


def decode_rows(runner: ModelRunner, rows: int, position: int) -> list[RowWork]:
    """``rows`` rows prefilled to ``position`` (one forward), each then feeding one decode token."""
    bs = runner.block_size
    per_row = position // bs + 2
    prompts = [[(7 * r + i) % 500 + 10 for i in range(position)] for r in range(rows)]
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    runner.forward([RowWork(t, p, 0, 1) for t, p in zip(tables, prompts)])
    return [RowWork(t, [42 + r], position, 1, decode=True) for r, t in enumerate(tables)]


def greedy_sampler(rows: int) -> Sampler:
    sampler = Sampler(EngineConfig.simple(rows), "cpu")
    batch = PersistentBatch(rows)
    batch.update([], [BatchEntry(f"r{i}", SamplingParams(temperature=0.0, max_tokens=8), [1, 2, 3], [])
                      for i in range(rows)])
    sampler.update_state(batch.take_update())
    return sampler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--position", type=int, default=100)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tiny", action="store_true", help="the tiny test model instead of the real one")
    parser.add_argument("--unmerged", action="store_true", help="transformers' layers as they are (the count before "
                        "workers.model.merged_layers)")
    args = parser.parse_args()
    path = model_path(args.tiny, args.dtype)
    runner = ModelRunner(path, "cpu", args.dtype, max_model_len=1024, max_rows=args.rows, verify=False,
                         decode_attention="torch", prepack_cpu_weights=False, block_size=16,
                         merge_projections=not args.unmerged, batch_invariant=False)  # the linears as on a GPU
    layers = runner.num_layers
    work = decode_rows(runner, args.rows, args.position)
    logits = runner.forward(work)
    sampler = greedy_sampler(args.rows)
    sampler_ops = top_level_ops(lambda: sampler(logits))
    print(f"model {Path(path).name}, {args.dtype}, {args.rows} rows at position {args.position}, {layers} layers")
    print(f"greedy sampler: {sum(sampler_ops.values())} operators a step "
          f"({sum(sampler_ops.values()) / layers:.1f} a layer)")
    from workers.model.static_decode import StaticDecoder

    fixed = StaticDecoder(runner, "eager", args.rows)
    shape = fixed.shape(work)
    results = {}
    for name, step in (("variable-shape forward (enforce_eager)", lambda: runner.forward(work)),
                       ("fixed-shape forward (what a CUDA graph captures)", lambda: fixed.forward(work, shape))):
        step()  # warm
        ops = top_level_ops(step)
        total = sum(ops.values()) + sum(sampler_ops.values())
        results[name] = ops
        print(f"{name}: {sum(ops.values())} operators a step; with the sampler {total / layers:.1f} a layer")
    for name, ops in results.items():
        per_layer = sorted(((n, c / layers) for n, c in ops.items() if c >= layers), key=lambda x: -x[1])
        print(f"  {name}, per layer: " + ", ".join(f"{n[6:]} {c:g}" for n, c in per_layer))
    return 0


if __name__ == "__main__":
    sys.exit(main())

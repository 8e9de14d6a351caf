"""What LoRA rows cost: a batch of 64 requests on the real model, spread over 4 adapters, against the same
batch on the base model, in one run.

Three engines, one after another, each on the same 64 prompts (greedy, ``--tokens`` each, ``ignore_eos``):

- ``base``: LoRA off (the engine as every other bench runs it: fused projections, static decode where the
  device has it);
- ``lora-off-rows``: ``lora.enabled`` with every row on the base model (what enabling LoRA costs alone:
  each projection stays its own module, steps run eagerly);
- ``lora-4``: ``lora.enabled``, the 64 rows split over 4 PEFT adapters of rank 16 on every q/k/v/o and
  gate/up/down projection (16 rows each, all in the same steps).

Printed: generated tokens per second of each (best of ``--repeats``), and each against ``base``. The
adapters are built here with PEFT (random, seeded). CPU: the engine's fixed row tiles (batch invariance) are
on, as everywhere.

    python bench/lora.py [--dtype float32|bfloat16] [--tokens 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]


def build_adapters(base: str, root: Path, count: int) -> list[Path]:
    from adapters import build_adapter

    return [build_adapter(base, root / f"a{i}", "all-r16", i) for i in range(count)]


def run(label: str, config: dict, prompts: list[list[int]], loras: list, tokens: int, repeats: int) -> float:
    from cluster.engine.local_engine import LocalEngine
    from processors import SamplingParams

    engine = LocalEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        engine.generate(prompts[:4], SamplingParams(max_tokens=2), lora_request=loras[:4] if loras else None)
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            outs = engine.generate(prompts, params, lora_request=loras or None)
            elapsed = time.perf_counter() - start
            assert all(o.error is None and len(o.outputs[0].token_ids) == tokens for o in outs), outs[0].error
            best = max(best, len(prompts) * tokens / elapsed)
    finally:
        engine.shutdown()
    print(f"  {label:<14} {best:8.1f} tok/s", flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kernels-as-is", action="store_true", help="model.batch_invariant: false (no row tiles)")
    args = parser.parse_args()

    from e2e import cpu_flags

    from cluster.config import resolve
    from processors import LoRARequest

    model = {"preset": "smollm2-135m-instruct", "dtype": args.dtype, "max_model_len": 256,
             "batch_invariant": not args.kernels_as_is}
    base = str(resolve({"model": model}).facts.path)
    prompts = [[1, 504, 3458, 282, 4649, 314, 253, 1345 + i, 30, 378, 1000 + 7 * i] for i in range(args.rows)]
    common = {"model": model, "scheduler": {"max_num_seqs": args.rows}, "cache": {"kv_cache_memory": "256MiB"}}
    print(f"bench/lora.py: {args.rows} rows x {args.tokens} tokens, {args.adapters} adapters of rank 16 on every "
          f"projection, {args.dtype}; CPU: {cpu_flags()}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        paths = build_adapters(base, Path(folder), args.adapters)
        loras = [LoRARequest(f"a{i % args.adapters}", i % args.adapters + 1, str(paths[i % args.adapters]))
                 for i in range(args.rows)]
        lora_config = {**common, "lora": {"enabled": True, "max_loras": args.adapters, "max_lora_rank": 16}}
        reference = run("base", common, prompts, [], args.tokens, args.repeats)
        enabled = run("lora-off-rows", lora_config, prompts, [], args.tokens, args.repeats)
        adapted = run(f"lora-{args.adapters}", lora_config, prompts, loras, args.tokens, args.repeats)
    print(f"lora enabled, base rows: {enabled / reference:.2f}x base; {args.adapters} adapters over "
          f"{args.rows} rows: {adapted / reference:.2f}x base", flush=True)


if __name__ == "__main__":
    main()

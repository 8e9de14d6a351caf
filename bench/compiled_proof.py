"""The compiled proof on the real model: ``LLM(model, enforce_eager=False)`` on CPU against the default.

    python bench/compiled_proof.py [--dtype float32 bfloat16] [--max-tokens 32] [--goldens]

``enforce_eager=False`` on CPU runs every one-token decode step through the fixed-shape forward under
``torch.compile(fullgraph=True)`` (workers/model/static_decode.py): the forward a GPU captures as CUDA
graphs, traced whole (a graph break, a host sync or a branch on a tensor's value would fail it).
Eight chat prompts of SmolLM2-135M-Instruct, greedy, through ``LLM(..., local=True).chat``: prints
how many answers are token-identical to the default CPU path's (prepacked, native kernels: float32
and bfloat16 the same answers here: both attend with the native kernel), how many
graphs were traced, and both runs' wall times (the compiled one includes tracing each shape once).

Then, at the runner level, 40 greedy decode steps of the same prompts: the compiled forward against
the same fixed-shape forward run eagerly (the same ops: tokens must be identical), and against the
default path with decode attention in torch (``decode_attention: torch``), for scale: in bfloat16 two
attention kernels (the native one, torch's) round their dot products differently, so answers that
meet a near-tie part ways.

``--goldens``: instead, every golden of ``tests/golden/engine_outputs.json`` (seven setups: 1-4 workers,
preemption, speculative decoding, structured outputs, thinking budgets, a custom processor) through the
compiled step, against its record (the suite runs two of them; all seven take about 90 s on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.entrypoints.llm import LLM  # noqa: E402
from processors import SamplingParams  # noqa: E402

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
         "Tell me a short story about a robot.", "Explain gravity to a child.", "What is 12 times 12?",
         "Name a famous painter.", "Why is the sky blue?"]


def answers(dtype: str, enforce_eager: bool | None, max_tokens: int) -> tuple[list[list[int]], float, int]:
    """(token ids of each answer, seconds, graphs traced)."""
    llm = LLM("smollm2-135m-instruct", local=True, dtype=dtype, max_model_len=1024, max_num_seqs=8,
              enforce_eager=enforce_eager)
    try:
        start = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": text}] for text in CHATS],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        seconds = time.perf_counter() - start
        static = llm.engine.workers[0].runner.static
        return [list(o.outputs[0].token_ids) for o in outs], seconds, static.compiled_graphs if static else 0
    finally:
        llm.shutdown()


def runner_tokens(dtype: str, steps: int, **options) -> list[list[int]]:
    """Greedy tokens of the chat prompts through one ModelRunner: a prefill, then ``steps`` decode steps."""
    from transformers import AutoTokenizer

    from cluster.config import load_config
    from workers.model.model_runner import ModelRunner
    from workers.model.static_decode import StaticDecoder
    from workers.row_work import RowWork

    path = load_config({"model": {"preset": "smollm2-135m-instruct", "dtype": dtype}}).model.resolve_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for text in CHATS]
    eager_fixed = options.pop("eager_fixed", False)
    runner = ModelRunner(path, "cpu", dtype, max_model_len=1024, max_rows=8, verify=False, block_size=16, **options)
    if eager_fixed:
        runner.static = StaticDecoder(runner, "eager", 8)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    logits = runner.forward([RowWork(t, p, 0, 1) for t, p in zip(tables, prompts)])
    tokens = [[int(x)] for x in logits.argmax(-1)]
    for step in range(steps):
        work = [RowWork(t, [tokens[i][-1]], len(prompts[i]) + step, 1, decode=True) for i, t in enumerate(tables)]
        for i, row in enumerate(runner.forward(work).argmax(-1).tolist()):
            tokens[i].append(row)
    return tokens


def goldens() -> int:
    """Every golden through ``enforce_eager=False``: how many requests match their records, per setup."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from golden_engine import GOLDEN, SETUPS, assert_same_record, run_setup

    expected = json.loads(GOLDEN.read_text())
    failed = False
    for name, workers, extra in SETUPS:
        start = time.perf_counter()
        got = run_setup(workers, {**extra, "model": {"tiny": "loopy", "max_model_len": 160, "enforce_eager": False}})
        wrong = []
        for rid, record in expected[name]["outputs"].items():
            try:
                assert_same_record(got["outputs"][rid], record, rid)
            except AssertionError:
                wrong.append(rid)
        failed |= bool(wrong)
        print(f"golden {name}: {len(expected[name]['outputs']) - len(wrong)}/{len(expected[name]['outputs'])} requests "
              f"as recorded through the compiled step ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--goldens", action="store_true", help="every golden through the compiled step instead")
    args = parser.parse_args()
    if args.goldens:
        return goldens()
    failed = False  # the compiled forward must give the same forward's eager tokens
    for dtype in args.dtype:
        eager, eager_s, _ = answers(dtype, None, args.max_tokens)
        compiled, compiled_s, graphs = answers(dtype, False, args.max_tokens)
        same = sum(a == b for a, b in zip(eager, compiled))  # reported: another attention kernel (above)
        print(f"{dtype}: enforce_eager=False (compiled, {graphs} graphs traced) vs the default CPU path: "
              f"{same}/{len(CHATS)} answers token-identical; {compiled_s:.1f} s against {eager_s:.1f} s", flush=True)
        compiled = runner_tokens(dtype, 40, enforce_eager=False)
        fixed = runner_tokens(dtype, 40, enforce_eager=False, eager_fixed=True)
        torch_attention = runner_tokens(dtype, 40, decode_attention="torch", prepack_cpu_weights=False)
        exact = sum(a == b for a, b in zip(compiled, fixed))
        failed |= exact != len(CHATS)
        print(f"{dtype}, 40 decode steps: compiled vs the fixed-shape forward run eagerly {exact}/{len(CHATS)} "
              f"token-identical; vs the default path with torch decode attention "
              f"{sum(a == b for a, b in zip(compiled, torch_attention))}/{len(CHATS)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Batch order and the prefix cache: a file that asks each document several questions, question by question.

Workload: 32 documents of about 400 tokens, 4 questions of about 20 tokens each (128 requests, 16
generated tokens each, seeded random sampling), on the real chat model (SmolLM2-135M-Instruct,
float32) with a KV cache that holds about a quarter of the documents. Two orders of the same
requests: document-major (a document's questions one after another) and question-major (every
document's first question, then every second, ...). In question-major order an engine that admits
in input order has evicted each document before its next question comes, and computes every
document once per question; raysample groups the requests by shared prefix before admitting them
(``input.group_by_prefix``), so both orders compute each document once.

Prints, per run: tokens/s (prompt + generated tokens per second), the prompt tokens computed and
their minimum (each document once), and the ratios.

    python bench/prefix_order.py                        # in process: grouped, both orders, and input order
    python bench/prefix_order.py --workers 2            # two workers in one engine (owner affinity)
    python bench/prefix_order.py --engines 2            # two data-parallel engines on Ray (engine affinity)
    python bench/prefix_order.py --against vllm --vllm-python /path/to/vllm-cpu/bin/python
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.config import resolve  # noqa: E402
from cluster.memory import ModelMemory  # noqa: E402
from processors import SamplingParams  # noqa: E402

DOCS, QUESTIONS, DOC_TOKENS, QUESTION_TOKENS, MAX_TOKENS = 32, 4, 400, 20, 16
BLOCK = 16
VLLM_BLOCK = 32  # vLLM's CPU attention takes multiples of 32; the same KV budget in tokens


def workload(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(documents, questions) as token ids of the model's vocabulary (ids past the special tokens)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(200, 40000) for _ in range(DOC_TOKENS + rng.randint(-20, 20))] for _ in range(DOCS)]
    questions = [[rng.randrange(200, 40000) for _ in range(QUESTION_TOKENS + rng.randint(-4, 4))]
                 for _ in range(DOCS * QUESTIONS)]
    return docs, questions


def requests(order: str) -> list[tuple[int, list[int]]]:
    """(request index, prompt ids) in ``order``; request d * QUESTIONS + q asks document d question q."""
    docs, questions = workload()
    pairs = [(d, q) for d in range(DOCS) for q in range(QUESTIONS)] if order == "document-major" else \
        [(d, q) for q in range(QUESTIONS) for d in range(DOCS)]
    return [(d * QUESTIONS + q, docs[d] + questions[d * QUESTIONS + q]) for d, q in pairs]


def minimum_prefill() -> int:
    """Each document once (its full blocks; its partial last block goes with every question), and every question."""
    docs, questions = workload()
    total = 0
    for d, doc in enumerate(docs):
        shared = len(doc) // BLOCK * BLOCK
        total += shared + sum(len(doc) - shared + len(q) for q in questions[d * QUESTIONS:(d + 1) * QUESTIONS])
    return total


def config(kv_tokens: int, workers: int, engines: int, grouped: bool) -> dict:
    base = {"model": {"preset": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 1024},
            "cluster": {"num_workers": workers, "num_engines": engines},
            "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 2048},
            "cache": {"block_size": BLOCK, "enable_prefix_caching": True},
            "input": {"group_by_prefix": grouped}}
    facts = resolve(base).facts
    base["cache"]["kv_cache_memory"] = kv_tokens * ModelMemory.of(facts, "float32").kv_per_token
    return base


def params_for(index: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=50, seed=index, max_tokens=MAX_TOKENS, ignore_eos=True)


def run_ours(order: str, kv_tokens: int, workers: int, engines: int, grouped: bool) -> dict:
    from cluster.entrypoints.llm import LLM

    job = requests(order)
    llm = LLM(config=config(kv_tokens, workers, engines, grouped), local=engines == 1)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        before = llm.engine.stats()
        start = time.perf_counter()
        outs = llm.generate([p for _, p in job], [params_for(i) for i, _ in job], use_tqdm=False)
        seconds = time.perf_counter() - start
        after = llm.engine.stats()
    finally:
        llm.shutdown()
    tokens = {i: o.outputs[0].token_ids for (i, _), o in zip(job, outs)}
    processed = sum(len(p) for _, p in job) + sum(len(t) for t in tokens.values())
    return {"seconds": seconds, "tokens_per_s": processed / seconds, "tokens": tokens,
            "computed": after["prefill_tokens"] - before["prefill_tokens"],
            "given": after["prompt_tokens"] - before["prompt_tokens"]}


def run_vllm(python: str, order: str, kv_tokens: int) -> dict:
    job = requests(order)
    facts = resolve({"model": {"preset": "smollm2-135m-instruct", "max_model_len": 1024}}).facts
    spec = {"model": str(facts.path), "prompts": [p for _, p in job], "max_tokens": [MAX_TOKENS] * len(job),
            "seeds": [i for i, _ in job], "sampling": "random", "max_num_seqs": 8, "max_model_len": 1024,
            "dtype": "float32", "kv_blocks": kv_tokens // VLLM_BLOCK, "block_size": VLLM_BLOCK}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    script = Path(__file__).resolve().parent / "vllm_reference.py"
    done = subprocess.run([python, str(script), f.name], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise SystemExit(f"vLLM failed:\n{done.stderr[-3000:]}")
    found = [line for line in done.stdout.splitlines() if line.startswith('{"tokens"')]
    if not found:
        raise SystemExit(f"vLLM printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    result = json.loads(found[-1])
    processed = sum(len(p) for _, p in job) + result["tokens"]
    return {"seconds": result["seconds"], "tokens_per_s": processed / result["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--engines", type=int, default=1, help="data-parallel engines (on a private Ray instance)")
    parser.add_argument("--kv-tokens", type=int, default=DOCS * (DOC_TOKENS + QUESTION_TOKENS + MAX_TOKENS) // 4,
                        help="KV cache per worker, in tokens (default: about a quarter of the documents)")
    parser.add_argument("--against", choices=["input-order", "vllm", "none"], default="input-order")
    parser.add_argument("--vllm-python", default=sys.executable, help="an interpreter with vllm-cpu installed")
    args = parser.parse_args()
    minimum = minimum_prefill()
    print(f"{DOCS} documents x {QUESTIONS} questions, {len(requests('document-major'))} requests; KV cache "
          f"{args.kv_tokens} tokens per worker; {args.workers} worker(s), {args.engines} engine(s); "
          f"prompt tokens computed at the least: {minimum}")
    runs = {}
    if args.against == "vllm":  # first, so that a vLLM that cannot run here says so at once
        reference = run_vllm(args.vllm_python, "question-major", args.kv_tokens)
    for name, order, grouped in (("document-major", "document-major", True), ("question-major", "question-major", True)):
        runs[name] = run_ours(order, args.kv_tokens, args.workers, args.engines, grouped)
    if args.against == "input-order":
        runs["question-major, input order"] = run_ours("question-major", args.kv_tokens, args.workers, args.engines, False)
    for name, r in runs.items():
        print(f"  raysample {name:28s} {r['tokens_per_s']:8.0f} tokens/s ({r['seconds']:6.1f} s); prompt tokens "
              f"computed {r['computed']} of {r['given']} ({r['computed'] / minimum:.2f}x the least)")
    same = runs["document-major"]["tokens"] == runs["question-major"]["tokens"]
    print(f"seeded tokens the same in both orders: {same}")
    doc, question = runs["document-major"], runs["question-major"]
    print(f"question-major / document-major time: {question['seconds'] / doc['seconds']:.2f}x")
    if args.against == "input-order":
        plain = runs["question-major, input order"]
        print(f"question-major, grouped / input order: {question['tokens_per_s'] / plain['tokens_per_s']:.2f}x tokens/s")
    elif args.against == "vllm":
        print(f"  vLLM      question-major             {reference['tokens_per_s']:8.0f} tokens/s "
              f"({reference['seconds']:6.1f} s)")
        print(f"question-major, raysample / vLLM: {question['tokens_per_s'] / reference['tokens_per_s']:.2f}x tokens/s")


if __name__ == "__main__":
    main()

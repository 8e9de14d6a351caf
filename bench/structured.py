"""Structured outputs: cost of JSON-schema constraints in the engine, and against transformers.

1. Engine: 64 requests at once (max_num_seqs 64) on the "bench" model, half of
   them constrained to a JSON schema (``disable_any_whitespace``), seeded random
   sampling, max_tokens 160 (constrained rows end with their object). Tokens/s
   of that batch vs the same batch unconstrained, where every row generates
   exactly as many tokens as it did constrained (``ignore_eos``, max_tokens =
   that count), so both runs have the same shape; the target is at most 15%
   slower.
2. Mask cost per step at V = 152k: 32 constrained rows of 64, bitmask fill for
   every row plus the masked apply on (64, 152064) float32 logits.
3. Reference: transformers ``generate`` with xgrammar's own transformers
   ``LogitsProcessor`` (``xgrammar.contrib.hf``) on the constrained half, in
   one batch, vs the engine on the same requests. Prints the ratio.

    python bench/structured.py
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.engine.local_engine import LocalEngine  # noqa: E402
from processors import SamplingParams  # noqa: E402
from workers.model.tiny import ensure_tiny_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["cat", "dog", "fox", "owl"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 1, "maximum": 99},
                                                   "vip": {"type": "boolean"}},
                  "required": ["age", "vip"], "additionalProperties": False},
    },
    "required": ["id", "kind", "tags", "owner"],
    "additionalProperties": False,
}
CONSTRAINT = {"json": SCHEMA, "disable_any_whitespace": True}
N = 64


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 8192) for _ in range(rng.randint(8, 32))] for _ in range(n)]


def engine() -> LocalEngine:
    eng = LocalEngine({"model": {"path": str(ensure_tiny_model("bench")), "dtype": "float32", "max_model_len": 256},
                       "scheduler": {"max_num_seqs": N}})
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, structured_outputs=CONSTRAINT))  # warm-up, compiles
    return eng


def run(eng: LocalEngine, batch: list[list[int]], constrained: set[int],
        lengths: list[int] | None = None) -> tuple[float, list[int], int]:
    """``lengths``: generate exactly that many tokens per row, without constraints."""
    params = [SamplingParams(seed=i, temperature=1.0, max_tokens=160 if lengths is None else lengths[i],
                             ignore_eos=lengths is not None,
                             structured_outputs=CONSTRAINT if i in constrained else None) for i in range(len(batch))]
    start = time.perf_counter()
    outs = eng.generate(batch, params)
    elapsed = time.perf_counter() - start
    valid = sum(1 for i in constrained if outs[i].finish_reason == "stop" and _valid(outs[i].text))
    return elapsed, [len(o.token_ids) for o in outs], valid


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:
        return False


def mask_cost(vocab: int = 152064, rows: int = 64, constrained: int = 32, repeats: int = 20) -> float:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("bench"))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(constrained)]
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    logits = torch.randn(rows, vocab)
    indices = list(range(0, rows, rows // constrained))[:constrained]
    start = time.perf_counter()
    for _ in range(repeats):
        for row, matcher in zip(indices, matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)
    return (time.perf_counter() - start) / repeats * 1000


def transformers_reference(batch: list[list[int]]) -> tuple[float, int]:
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor as XgrammarHF

    path = ensure_tiny_model("bench")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=160, do_sample=True,
                             logits_processor=[XgrammarHF(compiled)], pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    new = out[:, width:]
    tokens = int((new != tokenizer.pad_token_id).sum())
    return elapsed, tokens


def main() -> None:
    batch = prompts(N)
    half = set(range(0, N, 2))
    eng = engine()
    cons_s, lengths, valid = run(eng, batch, half)
    free_s, free_lengths, _ = run(eng, batch, set(), lengths)
    assert free_lengths == lengths
    free_rate, cons_rate = sum(lengths) / free_s, sum(lengths) / cons_s
    print(f"engine, {N} rows: unconstrained {free_rate:6.0f} tokens/s; half JSON-schema constrained "
          f"{cons_rate:6.0f} tokens/s ({valid}/{len(half)} valid objects); constrained / unconstrained: "
          f"{cons_rate / free_rate:.2f}x ({(1 - cons_rate / free_rate) * 100:+.0f}% slower)")
    print(f"mask cost per step at V=152064, 32 constrained rows of 64: {mask_cost():.2f} ms")
    constrained = [batch[i] for i in sorted(half)]
    ours_s, ours_lengths, _ = run(eng, constrained, set(range(len(constrained))))
    ref_s, ref_tokens = transformers_reference(constrained)
    ours, ref = sum(ours_lengths) / ours_s, ref_tokens / ref_s
    print(f"32 constrained requests: engine {ours:6.0f} tokens/s, transformers generate + xgrammar's "
          f"transformers LogitsProcessor {ref:6.0f} tokens/s; ratio {ours / ref:.2f}x")


if __name__ == "__main__":
    main()

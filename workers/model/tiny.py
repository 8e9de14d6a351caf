"""Tiny Llama-architecture models built locally, deterministically, without network.

Tests, benchmarks and ``configs/default.yaml`` use these. Each is saved as a
normal transformers directory (config.json, safetensors, tokenizer files), so
it is loaded through exactly the same path as a real model.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.host_cache import cache_root, manifest_problem, set_aside, write_manifest

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<think>", "</think>"]

# A small ChatML-like template so chat requests work offline; enable_thinking opens a <think> section.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% if enable_thinking %}<think>{% endif %}{% endif %}"
)

_BASE_TEXT = """\
The quick brown fox jumps over the lazy dog. A batch of requests shares one
forward pass; each request keeps its own cache and its own sampling settings.
Logits processors steer generation: they mask, bias or reshape the next-token
distribution. Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 appear too.
Unicode matters: café, naïve, Grüße, añejo, 東京, 你好世界, Привет, مرحبا, 🙂🚀✨.
Question: what is the answer? Answer: yes, no, maybe. Think first, then answer.
"""


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. ``vocab_size`` is the tokenizer's target size."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    initializer_range: float = 0.3  # large: random logits with clear winners, few near-ties
    seed: int = 0

    def fingerprint(self) -> str:
        blob = json.dumps({**asdict(self), "format": 3}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


PRESETS: dict[str, TinySpec] = {
    "default": TinySpec(),
    # Small weights: greedy output falls into loops, as real models do on repetitive text,
    # so n-gram drafts get accepted (speculative decoding tests).
    "loopy": TinySpec(initializer_range=0.05),
    # Nearly free forward pass: measures orchestration, not compute (bench/step_overhead.py).
    "micro": TinySpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1),
    # Scaled so the forward pass dominates a step on CPU (bench/e2e.py).
    "bench": TinySpec(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.02,  # transformers' default
    ),
    # The shape of SmolLM2-135M-Instruct with random weights: the real model's speed on a machine
    # the real weights cannot reach (bench/gpu_graphs.py); the tokenizer stops short of its vocabulary.
    "smollm2-shape": TinySpec(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        initializer_range=0.02,
    ),
}


def _corpus(seed: int) -> list[str]:
    """Base text plus pseudo-words from a fixed seed: enough pairs for thousands of merges."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "ch", "sh", "qu", "ng"]
    lines = _BASE_TEXT.splitlines()
    for _ in range(4000):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(4, 12))]
        lines.append(" ".join(words) + rng.choice([".", ",", "?", "!", ""]))
    return lines


def _build_tokenizer(spec: TinySpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    return tokenizer


def build_tiny_model(spec: TinySpec, out_dir: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    raw = _build_tokenizer(spec)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_tiny_model(preset: str | TinySpec = "default") -> Path:
    """Path of the tiny model directory, building it once (atomically) if missing."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown tiny model preset {preset!r}; known: {sorted(PRESETS)}")
        spec = PRESETS[preset]
    else:
        spec = preset
    target = cache_root() / "tiny" / spec.fingerprint()
    if target.is_dir():
        problem = manifest_problem(target)
        if problem is None:
            return target
        print(f"raysample: the tiny model does not verify: {problem}; building it again", file=sys.stderr, flush=True)
        set_aside(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build_tiny_model(spec, staging)
        write_manifest(staging, note=f"tiny model {spec}")
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if manifest_problem(target) is not None:
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target

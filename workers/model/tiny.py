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


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class TinySpec:
    """Shape of a random-weight model. ``vocab_size`` is the tokenizer's target size.

    ``weights``: ``"saved"`` writes random weights into the directory (small models); ``"random"`` writes
    only the config, tokenizer and ``random_weights.json``, and each worker builds the weights from the seed
    on its own device at load (``ModelRunner``): an 8B model's 16 GB never touch a disk or a wire."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    initializer_range: float = 0.3  # large: random logits with clear winners, few near-ties
    seed: int = 0
    architecture: str = "llama"  # llama | qwen2 (q/k/v bias) | qwen3 (per-head q/k norms) | mistral
    head_dim: int | None = None  # default: hidden_size / num_attention_heads
    rope_theta: float | None = None  # default: the architecture's
    tie_word_embeddings: bool = False
    weights: str = "saved"  # saved | random

    def fingerprint(self) -> str:
        fields = asdict(self)
        for name, default in _LATER_FIELDS.items():  # fields added later: absent at their default, so the
            if fields[name] == default:  # presets made before them keep their cache entries
                del fields[name]
        blob = json.dumps({**fields, "format": 3}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_LATER_FIELDS = {"architecture": "llama", "head_dim": None, "rope_theta": None, "tie_word_embeddings": False,
                 "weights": "saved"}
RANDOM_WEIGHTS = "random_weights.json"  # in a directory whose weights each worker builds from the seed


def _shape(architecture: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           max_positions: int, rope_theta: float, **extra: object) -> TinySpec:
    """A model of a real model's shape with random weights, built on the device (``weights="random"``)."""
    return TinySpec(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                    initializer_range=0.02, architecture=architecture, head_dim=hidden // heads,
                    rope_theta=rope_theta, weights="random", **extra)


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
    # The shapes users run (bf16 on a GPU; issue 78): random weights each worker builds on its device.
    # Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B, Mistral-7B-v0.3, and Llama-3.2-1B, which a CPU can run.
    "llama3-8b-shape": _shape("llama", 128256, 4096, 14336, 32, 32, 8, 131072, 500000.0),
    "qwen2.5-7b-shape": _shape("qwen2", 152064, 3584, 18944, 28, 28, 4, 32768, 1000000.0),
    "qwen3-8b-shape": _shape("qwen3", 151936, 4096, 12288, 36, 32, 8, 40960, 1000000.0),
    "mistral-7b-shape": _shape("mistral", 32768, 4096, 14336, 32, 32, 8, 32768, 1000000.0),
    "llama3.2-1b-shape": _shape("llama", 128256, 2048, 8192, 16, 32, 8, 131072, 500000.0, tie_word_embeddings=True),
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


def model_config(spec: TinySpec, bos: int, eos: int, pad: int) -> object:
    """The transformers config of ``spec``'s architecture and shape."""
    from transformers import AutoConfig

    if spec.architecture not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {spec.architecture!r}; known: {ARCHITECTURES}")
    extra: dict[str, object] = {}
    if spec.head_dim is not None:
        extra["head_dim"] = spec.head_dim
    if spec.rope_theta is not None:
        extra["rope_parameters"] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.architecture == "mistral":
        extra["sliding_window"] = None  # Mistral-7B-v0.3 attends to its whole context
    return AutoConfig.for_model(
        spec.architecture,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=spec.tie_word_embeddings,
        **extra,
    )


def build_tiny_model(spec: TinySpec, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    raw = _build_tokenizer(spec)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = model_config(spec, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tokenizer.save_pretrained(out_dir)
    if spec.weights == "random":
        config.save_pretrained(out_dir)
        generation.save_pretrained(out_dir)
        (out_dir / RANDOM_WEIGHTS).write_text(json.dumps({"seed": spec.seed}) + "\n")
        return
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.generation_config = generation
    model.save_pretrained(out_dir, safe_serialization=True)


def random_model(config: object, seed: int, dtype: object, device: object) -> object:
    """The random-weight model of a bench shape, the same on every worker of one device type: built on the
    meta device, then every parameter filled in order from one seeded generator (uniform with the config's
    standard deviation; norms' weights 1). One fill, on the device: a 1B model takes seconds on two cores,
    an 8B one a moment on a GPU (transformers' own init fills each weight twice)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(seed)
    bound = 3 ** 0.5 * getattr(config, "initializer_range", 0.02)  # uniform with that standard deviation
    with torch.no_grad():
        for _, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0 if parameter.dtype.is_floating_point else 0)
            else:
                parameter.uniform_(-bound, bound, generator=generator)
        for module in model.modules():  # buffers computed from the config (rotary frequencies), not weights
            if hasattr(module, "inv_freq") and hasattr(module, "config"):
                with torch.device("cpu"):
                    fresh = type(module)(config=module.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    getattr(module, name).copy_(buffer)
                module.attention_scaling = getattr(fresh, "attention_scaling", getattr(module, "attention_scaling", 1.0))
    return model.eval()


def random_weights_seed(model_path: str | Path) -> int | None:
    """The seed a worker builds this model's weights from on its device, or None for a model with weights."""
    marker = Path(model_path) / RANDOM_WEIGHTS
    if not marker.is_file():
        return None
    return int(json.loads(marker.read_text())["seed"])


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

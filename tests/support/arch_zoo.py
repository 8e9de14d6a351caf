"""Random tiny versions of popular decoder architectures, for the model-support tests.

Each is ``AutoConfig.for_model(model_type, **small shape, **features)`` saved
with the tiny tokenizer, so it loads through the same path as a real model.
Features that change attention (sliding windows shorter than the test
sequences, strong logit soft-capping, sinks, MoE routing) are set so that
ignoring them changes the greedy output.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from workers.host_cache import cache_root, one_maker
from workers.model.tiny import ensure_tiny_model

WINDOW = 8  # shorter than every test prompt

_SHAPE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}

_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
              "layer_types": ["full_attention", "sliding_attention"]},
    "qwen3": {},
    "qwen3_moe": {**_MOE, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    "gemma": {},
    "gemma2": {"sliding_window": WINDOW, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"pad_token_id": 0},
    "olmo2": {},
    "granite": {"attention_multiplier": 0.3, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
                "logits_scaling": 2.0},
    "starcoder2": {"sliding_window": WINDOW, "use_bias": True},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"], "intermediate_size": 64},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
}

# Shape keys some configs do not take (GPT-2 names its own).
_GPT2_DROP = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings"}


def arch_config(model_type: str, **overrides: Any):
    from transformers import AutoConfig

    shape = {k: v for k, v in _SHAPE.items() if not (model_type == "gpt2" and k in _GPT2_DROP)}
    return AutoConfig.for_model(model_type, **{**shape, **ARCHITECTURES[model_type], **overrides})


def build_arch_model(model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """Directory of a random tiny ``model_type`` model with the tiny tokenizer (built once, cached)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    key = json.dumps({"type": model_type, "seed": seed, "overrides": overrides, "v": 1}, sort_keys=True, default=str)
    target = cache_root() / "arch" / f"{model_type}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / "config.json").exists():
        return target
    # Both of the suite's workers (and their Ray actors) may ask for one model at once on a fresh host:
    # one builds it, the others wait and find it.
    with one_maker(target):
        if (target / "config.json").exists():
            return target
        tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("default"))
        config = arch_config(model_type, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             **overrides)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                                   eos_token_id=tokenizer.eos_token_id)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    return target

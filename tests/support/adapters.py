"""PEFT LoRA adapters built here for a model, and transformers + peft's greedy tokens with one.

PEFT starts ``lora_B`` at zero (an adapter that changes nothing); these are filled with seeded values
large enough to move the model's tokens, so a request that runs the wrong adapter, or none, shows.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

# name -> (rank, alpha, target modules, scale of the random weights): different ranks, attention-only,
# MLP-only and everything; each moves SmolLM2's greedy tokens away from the base model's.
KINDS = {
    "attn-r4": (4, 8, ["q_proj", "v_proj"], 0.08),
    "mlp-r8": (8, 16, ["gate_proj", "up_proj", "down_proj"], 0.04),
    "all-r16": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 0.04),
    "qko-r2": (2, 4, ["q_proj", "k_proj", "o_proj"], 0.08),
    # What an engine refuses: a rank above lora.max_lora_rank (16 by default), a module it has no LoRA layer for.
    "wide-r32": (32, 64, ["o_proj"], 0.02),
    "head-r4": (4, 8, ["lm_head"], 0.04),
}


def build_adapter(base: str | Path, folder: Path, kind: str, seed: int) -> Path:
    """A PEFT adapter directory for the model at ``base`` (``adapter_config.json`` + safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (folder / "adapter_model.safetensors").is_file():
        return folder
    rank, alpha, targets, scale = KINDS[kind]
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  lora_dropout=0.0, bias="none"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(folder))
    return folder


@lru_cache(maxsize=8)
def _peft_model(base: str, adapter: str | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def peft_greedy(base: str | Path, adapter: str | Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' (+ peft's, with an adapter) float32 eager greedy tokens for ``prompt``."""
    model = _peft_model(str(base), None if adapter is None else str(adapter))
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    past = None
    with torch.inference_mode():
        for _ in range(max_tokens):  # with the KV cache: each step feeds only the last token
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            ids = torch.tensor([[token]])
    return tokens

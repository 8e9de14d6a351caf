"""A PEFT LoRA adapter on disk: what it asks of the model, checked before any request runs with it.

Read without torch (``adapter_config.json`` and the safetensors header), so the coordinator can refuse a
request whose adapter cannot run, with one line, before a worker loads anything: a missing or malformed
directory, a rank above ``lora.max_lora_rank``, target modules the model lacks, weights of another model's
shapes, features a LoRA forward here does not compute (DoRA, trained biases, saved whole modules).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "base_model.model."
# The projections a LoRA may target here, and the (output, input) sizes each has in a decoder layer.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_FILES = ("adapter_model.safetensors",)


class AdapterError(ValueError):
    """The adapter cannot run on this model; one line naming the adapter and what is wrong."""


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter holds: per module name (``model.layers.0.self_attn.q_proj``), its rank and scaling."""

    path: Path
    modules: dict[str, tuple[int, float]]  # module name -> (rank, scaling)
    weights: Path
    max_rank: int


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection a LoRA may target in one decoder layer."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 1 << 28:
            raise ValueError("not a safetensors file")
        return json.loads(f.read(size))


def read_adapter(path: str | Path, hf_config: Any, max_rank: int) -> AdapterSpec:
    """The adapter at ``path`` as this model would run it; ``AdapterError`` if it cannot."""
    folder = Path(path).expanduser()
    where = f"LoRA adapter {folder}"
    if not folder.is_dir():
        raise AdapterError(f"{where}: no such directory")
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterError(f"{where}: no adapter_config.json (not a PEFT adapter directory)") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{where}: adapter_config.json cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{where}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    for key, why in (("use_dora", "DoRA adapters"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layers")):
        if config.get(key):
            raise AdapterError(f"{where}: {why} are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: trained biases (bias={config.get('bias')!r}) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{where}: whole modules saved with the adapter ({config['modules_to_save']}) are not "
                           "supported")
    weights = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if weights is None:
        raise AdapterError(f"{where}: no adapter_model.safetensors")
    try:
        header = _header(weights)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{where}: {weights.name} cannot be read ({exc})") from None
    shapes = projection_shapes(hf_config)
    layers = getattr(hf_config, "num_hidden_layers", 0)
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    modules: dict[str, tuple[int, float]] = {}
    pattern = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
    pairs: dict[str, dict[str, list[int]]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        match = pattern.match(name)
        if match is None:
            raise AdapterError(f"{where}: weight {key} is for a module this model's LoRA layers do not have "
                               f"(target modules here: {', '.join(TARGETS)} of each decoder layer)")
        layer, target, which = int(match.group(1)), match.group(2), match.group(3)
        if target not in TARGETS or layer >= layers:
            raise AdapterError(f"{where}: weight {key} targets {target} of layer {layer}, which this model lacks")
        module = name[: -len(f".lora_{which}.weight")]
        pairs.setdefault(module, {})[which] = list(entry.get("shape", []))
    if not pairs:
        raise AdapterError(f"{where}: {weights.name} holds no LoRA weights")
    for module, found in sorted(pairs.items()):
        target = module.rsplit(".", 1)[-1]
        out_features, in_features = shapes[target]
        a, b = found.get("A"), found.get("B")
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            raise AdapterError(f"{where}: {module} lacks its lora_A or lora_B weight")
        rank = a[0]
        if a[1] != in_features or b[0] != out_features or b[1] != rank:
            raise AdapterError(f"{where}: {module} has lora_A {tuple(a)} and lora_B {tuple(b)}, where this model's "
                               f"{target} takes {in_features} and gives {out_features}: an adapter for another model?")
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} of {module} is above lora.max_lora_rank={max_rank}")
        module_alpha = float(next((v for k, v in alpha_pattern.items() if module.endswith(k) or re.search(k, module)),
                                  alpha))
        modules[module] = (rank, module_alpha / (math.sqrt(rank) if rslora else rank))
    return AdapterSpec(folder, modules, weights, max(rank for rank, _ in modules.values()))

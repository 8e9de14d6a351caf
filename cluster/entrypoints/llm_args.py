"""vLLM's ``LLM(...)`` keywords to a raysample config.

vLLM users write ``LLM(model=..., dtype=..., max_model_len=..., logits_processors=[...])``;
the same call builds a ``RaysampleConfig`` here. Any other config key may be given by its
name when one section has it (``num_workers``, ``kv_cache_memory``), or as a whole section
(``scheduler={...}``). vLLM arguments that ask for something raysample does not do are
refused with the reason, never dropped.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from cluster.config import RaysampleConfig, load_config

# vLLM's name -> (section, key) where the names differ or are ambiguous.
RENAMED: dict[str, tuple[str, str]] = {
    "logits_processors": ("", "processors"),
    "seed": ("scheduler", "seed"),
    "tokenizer": ("model", "tokenizer"),
    "data_parallel_size": ("cluster", "num_engines"),
    "enable_lora": ("lora", "enabled"),
}

SECTION_ALIASES = {"speculative_config": "speculative"}  # vLLM's dict, with the same keys as ours
SECTIONS = ("model", "cluster", "scheduler", "cache", "structured_outputs", "speculative", "reasoning", "lora")

# vLLM arguments with no raysample counterpart: accepted only at the value that means "off".
REFUSED: dict[str, tuple[Any, str]] = {
    "pipeline_parallel_size": (1, "pipeline parallelism is not supported (see num_workers)"),
    "quantization": (None, "quantized execution is not supported; a GGUF file is dequantized to model.dtype"),
    "kv_cache_dtype": ("auto", "the KV cache is kept in the model's dtype; kv_cache_dtype other than 'auto' "
                               "is not supported"),
    "tokenizer_mode": ("auto", "only the model's Hugging Face tokenizer is supported (tokenizer_mode='auto')"),
}


def _fields(section: str) -> set[str]:
    annotation = RaysampleConfig.model_fields[section].annotation
    model_cls = next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))
    return set(model_cls.model_fields)


def model_section(model: str | dict[str, Any] | None) -> dict[str, Any]:
    """``model`` as vLLM takes it: a directory, hub id or ``.gguf`` file; here also a preset name."""
    from workers.model.model_source import PRESETS

    if model is None:
        return {}
    if isinstance(model, dict):
        return dict(model)
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a path, hub id, .gguf file or preset name; got {type(model).__name__}")
    model = str(model)
    return {"preset": model} if model in PRESETS else {"path": model}


def config_from_llm_args(model: str | dict[str, Any] | None = None,
                         config: RaysampleConfig | dict[str, Any] | str | Path | None = None,
                         **kwargs: Any) -> RaysampleConfig:
    """A config from ``config`` (a file, dict or config) with vLLM-style keywords laid over it."""
    data: dict[str, Any] = {}
    if config is not None:
        data = load_config(config).model_dump(by_alias=True, exclude_unset=True)
        data = copy.deepcopy(data)
    if model is not None:
        data["model"] = {**{k: v for k, v in data.get("model", {}).items()
                            if k not in ("path", "preset", "tiny", "gguf_file")}, **model_section(model)}
    if "model" not in data:
        raise TypeError("LLM() needs model=... (a path, hub id, .gguf file or preset name) or config=...")
    owners: dict[str, list[str]] = {}
    for section in SECTIONS:
        for key in _fields(section):
            owners.setdefault(key, []).append(section)
    for key, value in kwargs.items():
        key = SECTION_ALIASES.get(key, key)
        if key in REFUSED:
            off, why = REFUSED[key]
            if value != off:
                raise ValueError(f"{key}={value!r}: {why}")
            continue
        if key in SECTIONS or key in ("processors", "processors_from_entry_points", "defaults"):
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
            continue
        section, name = RENAMED.get(key, (None, key))
        if section is None:
            homes = owners.get(key, [])
            if len(homes) != 1:
                hint = f"it is a key of {' and '.join(homes)}; pass {homes[0]}={{{key!r}: ...}}" if homes else (
                    "not a vLLM argument raysample takes nor a raysample config key")
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}: {hint}")
            section = homes[0]
        if section:
            data.setdefault(section, {})
            if data[section] is None:
                data[section] = {}
            data[section][name] = value
        else:
            data[name] = value
    return load_config(data)

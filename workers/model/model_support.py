"""What the paged runner supports, read from a model's config before any weight loads.

Refused with one line naming what is wrong: layer kinds, RoPE variants whose
frequencies depend on the batch, chunked attention, ALiBi, shared KV layers, and a
``max_model_len`` past the model's positions. The second check, on the loaded model,
is ``workers.model.attention_probe``.
"""

from __future__ import annotations

from typing import Any

from workers.model.paged_attention import UnsupportedAttention

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# RoPE variants that rescale once the longest position of the *forward* passes a threshold:
# with many sequences packed in one forward, a row's rotation would depend on its neighbours.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def _rope_parameter_sets(config: Any) -> list[dict[str, Any]]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        return list(params.values())
    return [params] if params else []


DEFAULT_MAX_MODEL_LEN = 2048  # a config that states no limit (no max_position_embeddings) and none given


def resolved_max_model_len(config: Any, requested: int | None) -> int:
    """``model.max_model_len``, or the model's own limit when unset. More than the model's limit is
    refused, as vLLM refuses it: positions past what the model was built for give no error, only
    wrong text (transformers config: ``max_position_embeddings``)."""
    limit = getattr(config, "max_position_embeddings", None)
    if requested is None:
        return limit or DEFAULT_MAX_MODEL_LEN
    if limit is not None and requested > limit:
        arch = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise ValueError(f"model.max_model_len={requested} is more than {arch}'s limit of {limit} tokens "
                         f"(max_position_embeddings in its config.json); set model.max_model_len to at most {limit} "
                         "or leave it unset")
    return requested


def check_model_config(config: Any, max_model_len: int) -> None:
    """Raise ``UnsupportedAttention`` naming the first feature the runner cannot reproduce."""
    arch = (getattr(config, "architectures", None) or [config.model_type])[0]
    layer_types = set(getattr(config, "layer_types", None) or [])
    unknown = sorted(layer_types - SUPPORTED_LAYER_TYPES)
    if unknown:
        raise UnsupportedAttention(f"{arch}: layer type(s) {unknown} are not supported (only {sorted(SUPPORTED_LAYER_TYPES)})")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedAttention(f"{arch}: chunked attention (attention_chunk_size) is not supported")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        raise UnsupportedAttention(f"{arch}: ALiBi position biases are not supported")
    if getattr(config, "num_kv_shared_layers", 0):
        raise UnsupportedAttention(f"{arch}: KV sharing across layers (num_kv_shared_layers) is not supported")
    for params in _rope_parameter_sets(config):
        rope_type = params.get("rope_type", params.get("type"))
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            original = (params.get("original_max_position_embeddings")
                        or getattr(config, "original_max_position_embeddings", None)
                        or config.max_position_embeddings)
            if max_model_len > original:
                raise UnsupportedAttention(
                    f"{arch}: RoPE '{rope_type}' changes with the longest position in a forward pass beyond "
                    f"{original} tokens; set model.max_model_len <= {original}"
                )


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim

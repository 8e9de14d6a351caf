"""Refuse, at load, any model whose attention the paged runner cannot reproduce.

Two checks: the config's declared features (layer kinds, RoPE variants whose
frequencies depend on the batch, chunked attention, ALiBi, shared KV layers),
then a probe that runs a short sequence through the paged runner (two prefill
chunks and a decode step) and through transformers' eager attention and
compares the logits. A model that fails either is refused with one line naming
what is wrong; nothing is served wrongly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workers.paged_attention import ATTENTION_NAME, UnsupportedAttention

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# RoPE variants that rescale once the longest position of the *forward* passes a threshold:
# with many sequences packed in one forward, a row's rotation would depend on its neighbours.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def _rope_parameter_sets(config: Any) -> list[dict[str, Any]]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        return list(params.values())
    return [params] if params else []


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


def _probe_tokens(runner: ModelRunner) -> list[int]:
    length = max(2, min(3 * runner.block_size + 5, runner.max_model_len - 1))
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, runner.vocab_size, (length,), generator=generator).tolist()


_PROBED_SOURCES = ("model_runner.py", "model_support.py", "paged_attention.py", "native_attention.py",
                   "decode_layout.py", "native/paged_decode.cpp")


def probe_key(runner: ModelRunner, model_path: str | Path, trust_remote_code: bool) -> str | None:
    """What decides the probe's outcome: the model's files, the libraries, the runner's code and the
    layout. The same key passed before means the same computation passes again; None: do not cache
    (a hub id, or remote code that may change)."""
    import transformers

    path = Path(model_path)
    if trust_remote_code or not (path / "config.json").is_file():
        return None
    digest = hashlib.sha256()
    digest.update((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    here = Path(__file__).resolve().parent
    for name in _PROBED_SOURCES:
        source = here / name
        digest.update(source.read_bytes() if source.is_file() else b"-")
    layout = (torch.__version__, transformers.__version__, runner.device.type, str(runner.dtype), runner.block_size,
              runner.max_model_len, runner.native_decode, len(_probe_tokens(runner)))
    digest.update(repr(layout).encode())
    return digest.hexdigest()[:32]


def verify_once(runner: ModelRunner, model_path: str | Path, trust_remote_code: bool = False) -> None:
    """``verify_against_eager``, skipped when this exact model, code and layout passed it before on this
    host (a marker in the raysample cache); each worker otherwise spends seconds on it at every start."""
    from workers.model_source import cache_root

    key = probe_key(runner, model_path, trust_remote_code)
    marker = cache_root() / "probes" / key if key is not None else None
    if marker is not None and marker.is_file():
        return
    verify_against_eager(runner)
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{type(runner.model).__name__} passed the paged-attention probe\n")
        except OSError:
            pass  # an unwritable cache only means probing again next time


@torch.inference_mode()
def verify_against_eager(runner: ModelRunner) -> None:
    """Compare paged logits with eager attention on a probe; raise ``UnsupportedAttention`` if they differ."""
    from workers.model_runner import RowWork

    model = runner.model
    arch = type(model).__name__
    tokens = _probe_tokens(runner)
    blocks_needed = -(-len(tokens) // runner.block_size)
    if blocks_needed > runner.num_blocks:
        return  # the start-up check already refuses a cache this small
    table = list(range(blocks_needed))
    split = len(tokens) // 2
    try:
        first = runner.forward([RowWork(table, tokens[:split], 0, 1)])
        rest = runner.forward([RowWork(table, tokens[split:-1], split, len(tokens) - 1 - split)])
        last = runner.forward([RowWork(table, tokens[-1:], len(tokens) - 1, 1)])
    except UnsupportedAttention as exc:
        raise UnsupportedAttention(f"{arch}: {exc}") from None
    except Exception as exc:
        raise UnsupportedAttention(f"{arch}: its attention layers do not run on the paged runner ({type(exc).__name__}: {exc})") from None
    called = runner.last_step.layers_called if runner.last_step is not None else set()
    layers = runner.cache.keys
    if len(called) != len(layers):
        raise UnsupportedAttention(
            f"{arch}: {len(layers) - len(called)} of {len(layers)} attention layers do not go through "
            "transformers' AttentionInterface, so the paged KV cache cannot serve them"
        )
    paged = torch.cat([first, rest, last])
    model.set_attn_implementation("eager")
    try:
        reference = model(input_ids=torch.tensor([tokens], device=runner.device), use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    reference = reference[[split - 1, *range(split, len(tokens))]]
    scale = 1.0 + float(reference.abs().max())
    tolerance = (1e-4 if runner.dtype == torch.float32 else 2e-2) * scale
    error = float((paged - reference).abs().max())
    if not error <= tolerance:
        raise UnsupportedAttention(
            f"{arch}: logits on the paged runner differ from eager attention by {error:.3g} "
            f"(tolerance {tolerance:.3g}) on a {len(tokens)}-token probe; refusing a model whose attention "
            "cannot be reproduced"
        )

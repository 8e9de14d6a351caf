"""Llama-style decoder layers with fewer operators, for the GPU's path (and the compiled CPU proof).

On a GPU each operator a layer dispatches is at least one kernel launch, and transformers'
Llama layer dispatches about 70 (three q/k/v and two gate/up projections, an eight-op RMSNorm
twice, the rotary embedding applied to q and k apart, views and casts). This module rewrites a
layer whose code is Llama's (compared by bytecode, as transformers copies it into other
architectures) to the same arithmetic in fewer operators:

- q/k/v as one projection, gate/up as one (weights concatenated once at load);
- RMSNorm as ``torch.nn.functional.rms_norm`` (one fused op) where it gives what the module gives;
- the rotary embedding applied to q and k in one pass over their joint slice;
- no casts or copies that change nothing.

Every swap is checked at load on random inputs against the modules it replaces and kept only
where it gives their outputs within the dtype's rounding (libraries pick kernels by shape, so a
merged product is not bit for bit the separate ones). The CPU's own default path, which is exact
(``workers.cpu.cpu_fusion``), is untouched: this runs on GPUs, in the compiled CPU proof, and where asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.cpu.cpu_fusion import _same_code

logger = logging.getLogger(__name__)


def _concat_linear(linears: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([linear.weight.detach() for linear in linears])
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, dtype=weight.dtype,
                       device=weight.device)
    merged.weight.data = weight
    if merged.bias is not None:
        merged.bias.data = torch.cat([linear.bias.detach() for linear in linears])
    return merged.requires_grad_(False)


def _close(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Equal within the dtype's rounding: a merged product may take another kernel (on CPU, a single
    row's float32 product differs from the separate ones' in the last bits)."""
    tolerance = 1e-5 if want.dtype == torch.float32 else 2e-2
    return bool(((want.float() - got.float()).abs().max() <= tolerance * want.float().abs().max().clamp_min(1)).item())


def _random_rows(width: int, like: torch.Tensor) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, rows, width, generator=generator).to(like.dtype).to(like.device) for rows in (1, 7, 64)]


def _merged_matches(linears: list[nn.Linear], merged: nn.Linear) -> bool:
    for x in _random_rows(linears[0].in_features, linears[0].weight):
        parts = merged(x).split([lin.out_features for lin in linears], dim=-1)
        if not all(_close(lin(x), part) for lin, part in zip(linears, parts)):
            return False
    return True


def _fused_norm(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """One ``rms_norm`` where it gives the Llama RMSNorm's output (float32: the whole module; lower
    precision: the float32 part, rounded, then the weight as the module does)."""
    weight, eps = module.weight, module.variance_epsilon
    width = weight.shape[0]
    if weight.dtype == torch.float32:
        def candidate(x: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(x, (width,), weight, eps)
    else:
        def candidate(x: torch.Tensor) -> torch.Tensor:
            return weight * F.rms_norm(x.float(), (width,), None, eps).to(x.dtype)
    with torch.inference_mode():
        if all(_close(module(x), candidate(x)) for x in _random_rows(width, weight)):
            return candidate
    return None


def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` on q and k at once (the same products and sum per element)."""
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return qk * cos + rotated * sin


def _lean_layer_forward(layer: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                        position_ids: Any = None, position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("cache", "past_key_values", "use_cache"):  # our attention keeps its own cache
        kwargs.pop(name, None)
    tokens = hidden_states.shape[1]
    qkv = attn.qkv_proj(layer.lean_input_norm(hidden_states))
    qkv = qkv.view(1, tokens, -1, attn.head_dim).transpose(1, 2)  # (1, heads + 2 kv_heads, N, d)
    heads, kv_heads = attn.lean_heads
    cos, sin = position_embeddings
    qk = _rotate(qkv[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
    out, _ = attn.lean_attention(attn, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :], attention_mask,
                                 dropout=0.0, scaling=attn.scaling, **kwargs)
    hidden_states = hidden_states + attn.o_proj(out.reshape(1, tokens, -1))
    gate_up = mlp.gate_up_proj(layer.lean_post_norm(hidden_states))
    gate, up = gate_up.chunk(2, dim=-1)
    return hidden_states + mlp.down_proj(mlp.act_fn(gate) * up)


def _llama_classes() -> tuple[type, ...]:
    from transformers.models.llama import modeling_llama as llama

    return llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, llama.LlamaRMSNorm


def _is_llama_layer(layer: nn.Module) -> bool:
    layer_cls, attn_cls, mlp_cls, norm_cls = _llama_classes()
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (_same_code(type(layer).forward, layer_cls.forward) and attn is not None and mlp is not None
            and _same_code(type(attn).forward, attn_cls.forward) and _same_code(type(mlp).forward, mlp_cls.forward)
            and all(n is not None and _same_code(type(n).forward, norm_cls.forward) for n in norms)
            and all(type(lin) is nn.Linear for lin in linears))


def merge_layer(layer: nn.Module, attention: Callable) -> bool:
    """Rewrite one Llama-style decoder layer in place; False (layer untouched) where it is not one or a
    merged projection does not give the separate ones' outputs."""
    if not _is_llama_layer(layer):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = _concat_linear([mlp.gate_proj, mlp.up_proj])
    with torch.inference_mode():
        if not (_merged_matches([attn.q_proj, attn.k_proj, attn.v_proj], qkv)
                and _merged_matches([mlp.gate_proj, mlp.up_proj], gate_up)):
            return False
    head_dim = attn.head_dim
    heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    norms = [_fused_norm(n) or n for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    attn.qkv_proj, mlp.gate_up_proj = qkv, gate_up
    attn.lean_heads = (heads, kv_heads)
    attn.__dict__["lean_attention"] = attention
    layer.__dict__["lean_input_norm"], layer.__dict__["lean_post_norm"] = norms
    layer.forward = MethodType(_lean_layer_forward, layer)
    return True


def merge_layers(model: nn.Module, attention: Callable) -> int:
    """Every Llama-style decoder layer of ``model`` rewritten; returns how many."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    merged = sum(merge_layer(layer, attention) for layer in layers)
    if layers and merged < len(layers):
        logger.info("merged projections in %d of %d decoder layers (the others are not Llama-style or did not "
                    "match their separate projections)", merged, len(layers))
    return merged

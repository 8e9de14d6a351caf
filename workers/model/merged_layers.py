"""Pre-norm decoder layers with fewer operators, for the GPU's path (and the compiled CPU proof).

On a GPU each operator a layer dispatches is at least one kernel launch, and transformers'
Llama layer dispatches about 70 (three q/k/v and two gate/up projections, an eight-op RMSNorm
twice, the rotary embedding applied to q and k apart, views and casts). This module rewrites a
layer of the pre-norm decoder structure (Llama, Mistral, Qwen2 with its q/k/v bias, Qwen3 with its
per-head q/k norms: decided by the layer's parts, not by its code) to the same arithmetic in fewer
operators:

- q/k/v as one projection, gate/up as one (weights concatenated once at load);
- RMSNorm as ``torch.nn.functional.rms_norm`` (one fused op) where it gives what the module gives;
- the rotary embedding applied to q and k in one pass over their joint slice;
- no casts or copies that change nothing.

Every swap is checked at load on random inputs against the modules it replaces, and the whole lean
layer against the layer as written (both over one reference attention, which also records the
window, soft-capping and scaling the layer's own attention passes: the lean forward passes the same),
and kept only where it gives their outputs within the dtype's rounding (libraries pick kernels by shape, so a
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

from workers.model.paged_attention import ATTENTION_NAME

logger = logging.getLogger(__name__)


def _concat_linear(linears: list[nn.Linear]) -> nn.Linear:
    """Built on the meta device, then given the concatenated weights: a default initialisation of the merged
    matrix (a random fill of every weight of the layer's projections) would only be thrown away."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, dtype=weight.dtype,
                       device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if merged.bias is not None:
        merged.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False)
    return merged


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
    heads, kv_heads = attn.lean_heads
    cos, sin = position_embeddings
    if attn.lean_qk_norm:  # Qwen3: each head's q and k normed before the rotary embedding
        qkv = qkv.view(1, tokens, -1, attn.head_dim)
        q = attn.q_norm(qkv[:, :, :heads]).transpose(1, 2)
        k = attn.k_norm(qkv[:, :, heads: heads + kv_heads]).transpose(1, 2)
        v = qkv[:, :, heads + kv_heads:].transpose(1, 2)
        q, k = _rotate(q, cos.unsqueeze(1), sin.unsqueeze(1)), _rotate(k, cos.unsqueeze(1), sin.unsqueeze(1))
    else:
        qkv = qkv.view(1, tokens, -1, attn.head_dim).transpose(1, 2)  # (1, heads + 2 kv_heads, N, d)
        qk = _rotate(qkv[:, : heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
    out, _ = attn.lean_attention(attn, q, k, v, attention_mask, **{**kwargs, **attn.lean_kwargs})
    hidden_states = hidden_states + attn.o_proj(out.reshape(1, tokens, -1))
    gate_up = mlp.gate_up_proj(layer.lean_post_norm(hidden_states))
    gate, up = gate_up.chunk(2, dim=-1)
    return hidden_states + mlp.down_proj(mlp.act_fn(gate) * up)


_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QK_NORMS = {"q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def lean_shape(layer: nn.Module) -> str | None:
    """None where the layer has the pre-norm decoder structure the lean forward computes (Llama, Mistral,
    Qwen2 with its q/k/v bias, Qwen3 with its per-head q/k norms): two norms around attention (q/k/v/o
    linears) and a gated MLP (gate/up/down), nothing else. Else what differs. The structure decides which
    layers are tried; the numbers decide which are kept (``merge_layer``)."""
    children = {name for name, _ in layer.named_children()}
    if children != _LAYER_PARTS:
        return f"its parts are {sorted(children)}, not {sorted(_LAYER_PARTS)}"
    attn, mlp = layer.self_attn, layer.mlp
    attn_parts = {name for name, _ in attn.named_children()}
    if attn_parts not in (_ATTENTION_PARTS, _ATTENTION_PARTS | _QK_NORMS):
        return f"its attention holds {sorted(attn_parts)}"
    if {name for name, _ in mlp.named_children()} != _MLP_PARTS:
        return "its MLP is not gate/up/down (a mixture of experts, or another shape)"
    linears = [getattr(attn, n) for n in sorted(_ATTENTION_PARTS)] + [getattr(mlp, n) for n in ("gate_proj", "up_proj",
                                                                                               "down_proj")]
    if not all(type(lin) is nn.Linear for lin in linears):
        return "a projection is not a plain linear layer"
    if not isinstance(getattr(attn, "head_dim", None), int):
        return "its attention has no head_dim"
    return None


class _Recorder:
    """An attention function that records the keyword arguments a layer's own attention passes (the
    window, soft-capping, sinks, scaling: fixed per layer) and computes eager causal attention with them,
    the reference both the layer as written and its lean forward are checked against."""

    NAME = "raysample_reference"

    def __init__(self) -> None:
        self.seen: dict[str, Any] | None = None

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, softcap: float | None = None, s_aux: Any = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        recorded = {"scaling": scaling, "sliding_window": sliding_window, "softcap": softcap, "s_aux": s_aux}
        recorded.update({k: v for k, v in kwargs.items() if k in ("sinks",)})
        if self.seen is None:
            self.seen = {k: v for k, v in recorded.items() if v is not None}
        groups = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(groups, dim=1).float()
        v = value.repeat_interleave(groups, dim=1).float()
        scores = torch.matmul(query.float(), k.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        n = query.shape[2]
        pos = torch.arange(n, device=query.device)
        allowed = pos.view(1, -1) <= pos.view(-1, 1)
        if sliding_window is not None:
            allowed &= pos.view(1, -1) > pos.view(-1, 1) - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        sinks = s_aux if s_aux is not None else kwargs.get("sinks")
        if sinks is not None:
            sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).to(query.dtype)
        return out.transpose(1, 2), None


def merge_layer(model: nn.Module, layer: nn.Module, attention: Callable, recorder: _Recorder) -> str | None:
    """Rewrite one decoder layer in place to the lean forward; None when done, else why the layer keeps its own
    (untouched): it has another structure, or the lean forward does not give its outputs."""
    problem = lean_shape(layer)
    if problem is not None:
        return problem
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = _concat_linear([mlp.gate_proj, mlp.up_proj])
    with torch.inference_mode():
        if not (_merged_matches([attn.q_proj, attn.k_proj, attn.v_proj], qkv)
                and _merged_matches([mlp.gate_proj, mlp.up_proj], gate_up)):
            return "its merged projections do not give the separate ones' outputs"
    head_dim = attn.head_dim
    heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    norms = [_fused_norm(n) or n for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    original = {name: getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj")}
    original.update({name: getattr(mlp, name) for name in ("gate_proj", "up_proj")})
    with torch.inference_mode():
        recorder.seen = None
        model.set_attn_implementation(recorder.NAME)
        try:
            probe = _Lean(layer, qkv, gate_up, (heads, kv_heads), norms, recorder)
            matches = probe.check(model)
        finally:
            model.set_attn_implementation(ATTENTION_NAME)
    if not matches:
        return "its lean forward does not give its outputs"
    for name in original:
        delattr(attn if name.endswith(("q_proj", "k_proj", "v_proj")) else mlp, name)
    probe.install(attention)
    return None


class _Lean:
    """A layer's lean forward, built beside the layer before it is installed in it."""

    def __init__(self, layer: nn.Module, qkv: nn.Linear, gate_up: nn.Linear, heads: tuple[int, int],
                 norms: list[Any], recorder: _Recorder) -> None:
        self.layer, self.qkv, self.gate_up, self.heads, self.norms = layer, qkv, gate_up, heads, norms
        self.recorder = recorder
        self.fixed: dict[str, Any] | None = None

    def _attach(self, attention: Callable, fixed: dict[str, Any]) -> None:
        layer, attn, mlp = self.layer, self.layer.self_attn, self.layer.mlp
        attn.qkv_proj, mlp.gate_up_proj = self.qkv, self.gate_up
        attn.lean_heads = self.heads
        attn.lean_qk_norm = hasattr(attn, "q_norm")
        attn.__dict__["lean_attention"] = attention
        attn.__dict__["lean_kwargs"] = fixed
        layer.__dict__["lean_input_norm"], layer.__dict__["lean_post_norm"] = self.norms

    def _detach(self) -> None:
        attn, mlp = self.layer.self_attn, self.layer.mlp
        for owner, name in ((attn, "qkv_proj"), (mlp, "gate_up_proj")):
            if name in owner._modules:
                del owner._modules[name]
        for owner, name in ((attn, "lean_attention"), (attn, "lean_kwargs"), (attn, "lean_heads"),
                            (attn, "lean_qk_norm"), (self.layer, "lean_input_norm"), (self.layer, "lean_post_norm")):
            owner.__dict__.pop(name, None)

    def check(self, model: nn.Module) -> bool:
        """The layer as written and the lean forward, over the recorder; the layer's recorded attention
        arguments become the lean forward's fixed ones."""
        layer, recorder = self.layer, self.recorder
        weight = layer.self_attn.o_proj.weight
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, 12, weight.shape[0], generator=generator).to(device=weight.device, dtype=weight.dtype)
        positions = torch.arange(12, device=weight.device).view(1, -1)
        embeddings = model.model.rotary_emb(hidden, positions)
        want = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=embeddings)
        want = want[0] if isinstance(want, tuple) else want
        self.fixed = dict(recorder.seen or {})
        self._attach(recorder, self.fixed)
        try:
            got = _lean_layer_forward(layer, hidden, attention_mask=None, position_ids=positions,
                                      position_embeddings=embeddings)
        finally:
            self._detach()
        tolerance = 1e-4 if want.dtype == torch.float32 else 3e-2
        return bool(((want.float() - got.float()).abs().max() <= tolerance * want.float().abs().max().clamp_min(1)))

    def install(self, attention: Callable) -> None:
        self._attach(attention, self.fixed or {})
        self.layer.forward = MethodType(_lean_layer_forward, self.layer)


def merge_layers(model: nn.Module, attention: Callable) -> int:
    """Every decoder layer of ``model`` with the lean structure rewritten; returns how many. A model none
    of whose layers can be merged keeps its own layers (one line says why): a GPU runs them as they are."""
    from transformers import AttentionInterface

    layers = getattr(getattr(model, "model", None), "layers", None) or []
    if not layers or getattr(getattr(model, "model", None), "rotary_emb", None) is None:
        logger.info("%s: layers not merged (no decoder layers with a shared rotary embedding)", type(model).__name__)
        return 0
    recorder = _Recorder()
    AttentionInterface.register(recorder.NAME, recorder)
    reasons = [merge_layer(model, layer, attention, recorder) for layer in layers]
    merged = sum(reason is None for reason in reasons)
    if merged < len(layers):
        first = next(reason for reason in reasons if reason is not None)
        logger.warning("%s: %d of %d decoder layers keep their own forward (%s); they run as transformers writes "
                       "them", type(model).__name__, len(layers) - merged, len(layers), first)
    return merged

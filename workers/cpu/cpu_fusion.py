"""Fewer, larger CPU ops for transformers' decoder layers, bit for bit what the layers compute.

On CPU a step's time outside the matmuls goes to many small ops and to memory traffic on big
prefill activations (measured on SmolLM2-135M: a 2,048-token prefill spent 1.8 s of 5.8 s in
elementwise ops). Four swaps, each made only where it is exact:

- q/k/v projections that read the same input become one matmul whose output is split
  (``SharedInputLinears``); gate/up likewise;
- a Llama-style MLP (``down(silu(gate(x)) * up(x))``) runs its SiLU and product in place on the
  fused gate/up output, instead of three new activations;
- a Llama-style RMSNorm is one call of the exact native kernel (``workers.cpu.exact_ops``), or in
  float32 without it ``torch.nn.functional.rms_norm``, one fused op;
- a Llama-style attention applies its rotary embedding to q and k in one native call each.

Each swap is checked at load on a random input against the module it replaces and kept only if
the outputs are identical (``torch.equal``) on this CPU. The check runs once per shape: kernels are
picked by shape, dtype and CPU, never by the values, so the layers that share the first one's shapes
take its verdict (a 30-layer model: 0.3 s of checks instead of 2). A module whose forward is not the
Llama one (compared by bytecode, as transformers copies it into other architectures) keeps its
own. Prepacked oneDNN weights (``workers.cpu.cpu_linear``) are used for the fused linears.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from workers.cpu import exact_ops
from workers.cpu.cpu_linear import PrepackedLinear

logger = logging.getLogger(__name__)

_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]  # a kept verdict is this code's
_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _same_code(a: Callable, b: Callable) -> bool:
    """Whether two functions are the same code (transformers copies a class's forward verbatim)."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return ca is not None and cb is not None and (ca.co_code, ca.co_consts, ca.co_names) == (
        cb.co_code, cb.co_consts, cb.co_names)


def _fused_linear(linears: list[nn.Linear]) -> PrepackedLinear:
    weight = torch.cat([linear.weight.detach() for linear in linears])
    fused = torch.nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                                     dtype=weight.dtype, device=weight.device)  # no random init: replaced at once
    fused.weight.data = weight
    if fused.bias is not None:
        fused.bias.data = torch.cat([linear.bias.detach() for linear in linears])
    return PrepackedLinear(fused)


class SharedInputLinears(nn.Module):
    """One matmul for several projections of the same input; each member returns its slice.

    The first member called with a tensor computes all outputs; the others, called with that same
    tensor (the same object, not written in between), take their slice. A member called with any other input
    computes the fused product again, so the result is right whatever order the layer uses.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.fused = _fused_linear(linears)
        self.sizes = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None
        self._version = -1
        self._outputs: tuple[torch.Tensor, ...] = ()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        # Inference tensors keep no version counter: there, the same object is the same input (the
        # layers we fuse never write to their input between the projections).
        version = -1 if x.is_inference() else x._version
        if x is not self._input or version != self._version:
            self._outputs = self.fused(x).split(self.sizes, dim=-1)
            self._input, self._version = x, version
        out = self._outputs[index]
        if index == len(self.sizes) - 1:  # the last member: let the activations go
            self._input, self._outputs = None, ()
        return out


class SharedInputMember(nn.Module):
    def __init__(self, group: SharedInputLinears, index: int) -> None:
        super().__init__()
        self.__dict__["group"] = group  # not a submodule: the group's weights are not counted per member
        self.index = index
        self.in_features = group.fused.in_features
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


def _llama_mlp_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with the SiLU and the product in place on one gate/up output."""
    gate_up = module.gate_up(x)
    half = gate_up.shape[-1] // 2
    gate = gate_up[..., :half]
    F.silu(gate, inplace=True)
    gate.mul_(gate_up[..., half:])
    return module.down_proj(gate)


def _llama_rms_norm_forward(original: Callable, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:  # the original rounds to the input dtype before the weight
        return original(x)
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


def _native_rms_norm_forward(original: Callable, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = exact_ops.rms_norm(x, module.weight, module.variance_epsilon)
    return original(x) if out is None else out


def _same_outputs(reference: Callable[[torch.Tensor], torch.Tensor], candidate: Callable[[torch.Tensor], torch.Tensor],
                  width: int, like: torch.Tensor) -> bool:
    """Bit-for-bit equal outputs on random inputs of a few shapes (decode rows, a prefill chunk)."""
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 7, 64, 300):
        x = torch.randn(1, rows, width, generator=generator).to(like.dtype).to(like.device)
        want, got = reference(x), candidate(x)
        outputs = zip(want, got) if isinstance(want, tuple) else [(want, got)]
        if not all(torch.equal(a, b) for a, b in outputs):
            return False
    return True


class Verdicts:
    """The checks' results by shape (and dtype, device, kind): a layer like one checked before takes its verdict.
    With a ``store``, a yes/no verdict is also kept on disk for this CPU, torch, thread count and code
    (``row_tiles.checked_once``): every worker process of every run would otherwise check again (about 2 s of
    a real model's load here, the check's own prepacked copies included)."""

    def __init__(self, store: Path | None = None) -> None:
        self._seen: dict[tuple, object] = {}
        self.store = store

    def of(self, key: tuple, check: Callable[[], object], yes_no: bool = False) -> object:
        if key not in self._seen:
            if yes_no and self.store is not None:
                from workers.cpu.row_tiles import checked_once

                shape = ("cpu-fusion", *map(repr, key), _SOURCE_DIGEST)
                self._seen[key] = checked_once(self.store, shape, lambda: bool(check()))
            else:
                self._seen[key] = check()
        return self._seen[key]


def _shape_key(linears: list[nn.Linear]) -> tuple:
    return tuple((lin.in_features, lin.out_features, lin.bias is None, lin.weight.dtype, lin.weight.device)
                 for lin in linears)


def _fuse_llama_mlp(module: nn.Module, verdicts: Verdicts) -> bool:
    from transformers.models.llama.modeling_llama import LlamaMLP

    linears = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not (_same_code(type(module).forward, LlamaMLP.forward) and all(type(lin) is nn.Linear for lin in linears)
            and type(getattr(module, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")):
        return False
    fused = _fused_linear(linears[:2])
    down_packed = PrepackedLinear(linears[2])

    def check() -> bool:
        gate, up, down = (PrepackedLinear(lin) for lin in linears)
        return _same_outputs(lambda x: down(module.act_fn(gate(x)) * up(x)),
                             MethodType(_llama_mlp_forward, _FusedMlpView(fused, down_packed)),
                             linears[0].in_features, linears[0].weight)

    if not verdicts.of(("mlp", type(module.act_fn), *_shape_key(linears)), check, yes_no=True):
        return False
    del module.gate_proj, module.up_proj
    module.gate_up, module.down_proj = fused, down_packed
    module.forward = MethodType(_llama_mlp_forward, module)
    return True


class _FusedMlpView:
    """The two attributes ``_llama_mlp_forward`` reads, for checking before the module is changed."""

    def __init__(self, gate_up: nn.Module, down_proj: nn.Module) -> None:
        self.gate_up, self.down_proj = gate_up, down_proj


def _share_input(module: nn.Module, names: tuple[str, ...], verdicts: Verdicts) -> bool:
    linears = [getattr(module, n, None) for n in names]
    if not all(type(lin) is nn.Linear for lin in linears):
        return False
    if len({(lin.in_features, lin.bias is None, lin.weight.dtype, lin.weight.device) for lin in linears}) != 1:
        return False
    group = SharedInputLinears(linears)

    def check() -> bool:
        separate = [PrepackedLinear(lin) for lin in linears]
        return _same_outputs(lambda x: tuple(lin(x) for lin in separate),
                             lambda x: tuple(group.output(x, i) for i in range(len(names))),
                             linears[0].in_features, linears[0].weight)

    if not verdicts.of(("shared", *_shape_key(linears)), check, yes_no=True):
        return False
    module.add_module(f"{names[0]}_shared", group)  # in the module tree once (prepacked already)
    for index, name in enumerate(names):
        setattr(module, name, SharedInputMember(group, index))
    return True


def _fuse_rms_norm(module: nn.Module, verdicts: Verdicts) -> bool:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if not (_same_code(type(module).forward, LlamaRMSNorm.forward) and hasattr(module, "variance_epsilon")):
        return False
    original = module.forward
    candidates = [MethodType(lambda self, x: _llama_rms_norm_forward(original, self, x), module)]
    if exact_ops.available() and exact_ops.sum_lanes(module.weight.shape[-1], module.variance_epsilon) is not None:
        candidates.insert(0, MethodType(lambda self, x: _native_rms_norm_forward(original, self, x), module))
    weight = module.weight
    key = ("rms_norm", len(candidates), tuple(weight.shape), module.variance_epsilon, weight.dtype, weight.device)
    chosen = verdicts.of(key, lambda: next((i for i, candidate in enumerate(candidates)
                                            if _same_outputs(original, candidate, weight.shape[-1], weight)), None))
    if chosen is None:
        return False
    module.forward = candidates[chosen]
    return True


def _llama_attention_forward(module: nn.Module, hidden_states: torch.Tensor,
                             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                             attention_mask: torch.Tensor | None = None, cache=None, **kwargs):
    """LlamaAttention's forward with the rotary embedding as one native call per tensor.

    Only installed on a module whose forward is Llama's code and whose module's
    ``apply_rotary_pos_emb`` the kernel matches bit for bit (``_fuse_rotary``); any input the kernel
    does not take goes to that function.
    """
    heads_shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_proj(hidden_states).view(heads_shape).transpose(1, 2)
    key = module.k_proj(hidden_states).view(heads_shape).transpose(1, 2)
    value = module.v_proj(hidden_states).view(heads_shape).transpose(1, 2)
    cos, sin = position_embeddings
    rotated = exact_ops.rotary(query, key, cos, sin)
    query, key = rotated if rotated is not None else module.__dict__["_eager_rotary"](query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    names = module.__dict__["_attention_names"]
    attend = names["ALL_ATTENTION_FUNCTIONS"].get_interface(module.config._attn_implementation,
                                                            names["eager_attention_forward"])
    output, weights = attend(module, query, key, value, attention_mask,
                             dropout=0.0 if not module.training else module.attention_dropout,
                             scaling=module.scaling, **kwargs)
    return module.o_proj(output.reshape(*heads_shape[:-2], -1).contiguous()), weights


def _fuse_rotary(module: nn.Module) -> bool:
    from transformers.models.llama import modeling_llama

    forward = inspect.unwrap(getattr(type(module), "forward", None) or (lambda: None))
    if not _same_code(forward, inspect.unwrap(modeling_llama.LlamaAttention.forward)):
        return False
    names = forward.__globals__  # the module that defines this attention: its rotary and attention functions
    eager_rotary = names.get("apply_rotary_pos_emb")
    if not (callable(eager_rotary) and "ALL_ATTENTION_FUNCTIONS" in names and "eager_attention_forward" in names
            and _same_code(inspect.unwrap(eager_rotary), inspect.unwrap(modeling_llama.apply_rotary_pos_emb))):
        return False
    config = module.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dtype = next(t.dtype for t in (*module.parameters(), *module.buffers()) if t.is_floating_point())
    if not (exact_ops.available() and exact_ops.rotary_exact(eager_rotary, heads, kv_heads, module.head_dim, dtype)):
        return False
    module.__dict__["_eager_rotary"] = eager_rotary
    module.__dict__["_attention_names"] = {n: names[n] for n in ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")}
    module.forward = MethodType(_llama_attention_forward, module)
    return True


def fuse_cpu_layers(model: nn.Module, projections: bool = True, store: Path | None = None) -> dict[str, int]:
    """Apply every exact swap to ``model``, then prepack the remaining linears; returns what was done.
    ``projections=False`` keeps each projection a module of its own (LoRA adapters wrap them). ``store``:
    where the fused projections' verdicts are kept between processes (None: checked in each)."""
    from workers.cpu.cpu_linear import prepack_linears

    counts = {"mlp": 0, "shared_input": 0, "rms_norm": 0, "rotary": 0}
    verdicts = Verdicts(store)
    with torch.inference_mode():
        for module in list(model.modules()):
            if projections and _fuse_llama_mlp(module, verdicts):
                counts["mlp"] += 1
            for names in _PROJECTIONS if projections else ():
                counts["shared_input"] += _share_input(module, names, verdicts)
            counts["rms_norm"] += _fuse_rms_norm(module, verdicts)
            counts["rotary"] += _fuse_rotary(module)
        counts["prepacked"] = prepack_linears(model)
    logger.debug("CPU layer fusion: %s", counts)
    return counts

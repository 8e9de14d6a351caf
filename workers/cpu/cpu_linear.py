"""oneDNN weight prepacking for linear layers on CPU.

On the CPUs here ``torch.nn.functional.linear`` runs the decode-sized matmuls
of a step 1.2-3x slower than oneDNN with weights reordered once into its
blocked layout (what torch.compile's CPU backend does): 2-3x in float32
(MKL), 1.2-2.4x in bfloat16 (oneDNN without the reorder). The model's
``nn.Linear`` modules are swapped in place for this module; results agree
with ``nn.Linear`` to float rounding (bitwise, in the cases measured).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

_BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows
MIN_ROWS = 2


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    if not (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    if dtype == torch.float32:
        return True
    # bfloat16 only where oneDNN has native bf16 kernels (AVX-512 or newer); elsewhere it would emulate.
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PrepackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.weight_dtype = weight.dtype
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def compute(self, flat: torch.Tensor) -> torch.Tensor:
        """``[M, in_features] -> [M, out_features]``: the matmul itself (``workers.cpu.row_invariance`` probes it)."""
        rows = flat.shape[0]
        if rows < MIN_ROWS:  # oneDNN takes another kernel for one row: pad, so a row's result never depends on M
            flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, self.in_features)])
        elif not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out[:rows] if rows < MIN_ROWS else out


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``model``; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PrepackedLinear(child))
                replaced += 1
    return replaced

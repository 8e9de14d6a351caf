"""RMSNorm and the rotary embedding as one C++ call each (``workers/cpu/native/exact_ops.cpp``).

Why: in a bfloat16 decode step on CPU, transformers' RMSNorm is nine torch ops and its rotary
embedding twelve, each a dispatch and a pass over memory, 61 norms and 30 rotations a step for
SmolLM2. The kernel computes what those ops compute, rounding for rounding, including the order
of torch's float sum; ``workers.cpu.cpu_fusion`` swaps it in only where the checks here find the
outputs identical on this CPU (in float32, where a different sum or a fused multiply-add would
show in the last bit, and in the model's dtype). Where no compiler is found, nothing is swapped.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from workers.cpu import native_build
from workers.cpu.native_build import NativeKernelUnavailable

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "exact_ops.cpp"
# No -fassociative-math and no contraction into FMAs: every rounding stays where torch has it.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC",
         "-std=c++17"]
ABI_VERSION = 1
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    library = ctypes.CDLL(str(native_build.build(SOURCE, FLAGS)))
    if library.raysample_exact_ops_abi_version() != ABI_VERSION:
        raise NativeKernelUnavailable(f"{SOURCE.name}: ABI {library.raysample_exact_ops_abi_version()}, "
                                      f"expected {ABI_VERSION}")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.raysample_rms_norm.argtypes = [p, i64, p, p, i32, i64, i64, ctypes.c_float, i32, i32]
    library.raysample_rotary.argtypes = [p, i64, i64, i64, p, p, i64, p, i32, i64, i64, i32]
    library.raysample_rms_norm.restype = ctypes.c_bool
    library.raysample_rotary.restype = None
    return library


def available() -> bool:
    return native_build.loads(_library, "exact native RMSNorm/rotary unavailable, using torch's ops")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Llama's RMSNorm of ``x``; None where the kernel does not apply or is not exact here (the
    caller runs the eager code)."""
    width = x.shape[-1]
    if not (x.device.type == "cpu" and x.dtype in DTYPE_CODES and weight.dtype == x.dtype
            and weight.shape == (width,) and weight.is_contiguous() and x.numel()):
        return None
    lanes = sum_lanes(width, eps)
    return None if lanes is None else _rms_norm(x, weight, eps, lanes)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if not _library().raysample_rms_norm(flat.data_ptr(), flat.stride(0), weight.data_ptr(), out.data_ptr(),
                                         DTYPE_CODES[x.dtype], flat.shape[0], width, eps, lanes,
                                         torch.get_num_threads()):
        raise ValueError(f"the kernel has no sum of {lanes} lanes")
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _, heads, tokens, dim = x.shape
    out = torch.empty(1, tokens, heads, dim, dtype=x.dtype)
    _library().raysample_rotary(x.data_ptr(), x.stride(2), x.stride(1), heads, cos.data_ptr(), sin.data_ptr(),
                                cos.stride(1), out.data_ptr(), DTYPE_CODES[x.dtype], tokens, dim,
                                torch.get_num_threads())
    return out.transpose(1, 2)  # the layout torch's elementwise ops give a transposed projection


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Llama's ``apply_rotary_pos_emb`` for one packed sequence: q/k ``(1, heads, N, d)``, cos/sin
    ``(1, N, d)``; None where the kernel does not apply."""
    dtype = q.dtype
    if not (dtype in DTYPE_CODES and k.dtype == cos.dtype == sin.dtype == dtype and q.device.type == "cpu"
            and q.dim() == k.dim() == 4 and q.shape[0] == k.shape[0] == 1 and cos.dim() == 3
            and cos.shape == sin.shape == (1, q.shape[2], q.shape[3]) == (1, k.shape[2], k.shape[3])
            and q.shape[3] % 2 == 0 and q.stride(3) == k.stride(3) == cos.stride(2) == sin.stride(2) == 1
            and cos.stride(1) == sin.stride(1)):
        return None
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference: transformers' LlamaRMSNorm, op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@lru_cache(maxsize=None)
def sum_lanes(width: int, eps: float) -> int | None:
    """How many floats per vector torch's CPU sum kernel adds side by side here: the order of its
    additions, found as the one with which the kernel's float32 RMSNorm equals torch's bit for bit
    (a wrong order shows in the last bit of about half the rows). It is not the CPU's widest
    vector: on AVX-512 CPUs torch 2.13 runs its sum kernel at AVX2's 8. None: no order matches."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(width, generator=generator)
    inputs = [torch.randn(1, rows, width, generator=generator) * 3 for rows in (1, 5, 64, 257)]
    for lanes in (8, 16, 4):
        if all(torch.equal(_rms_norm(x, weight, eps, lanes), _eager_rms_norm(x, weight, eps)) for x in inputs):
            return lanes
    logger.info("native RMSNorm differs from torch's at width %d: not used", width)
    return None


def rotary_exact(apply_rotary: Callable, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> bool:
    """The kernel equals ``apply_rotary`` (a model's ``apply_rotary_pos_emb``) bit for bit, in float32
    and in ``dtype``, on projections laid out as a fused q/k/v output is."""
    generator = torch.Generator().manual_seed(0)
    for check_dtype in dict.fromkeys((torch.float32, dtype)):
        for tokens in (1, 7, 64):
            qkv = (torch.randn(1, tokens, (heads + 2 * kv_heads) * dim, generator=generator) * 4).to(check_dtype)
            q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q = q.view(1, tokens, heads, dim).transpose(1, 2)
            k = k.view(1, tokens, kv_heads, dim).transpose(1, 2)
            angles = torch.rand(1, tokens, dim, generator=generator) * 100
            cos, sin = angles.cos().to(check_dtype), angles.sin().to(check_dtype)
            got, want = rotary(q, k, cos, sin), apply_rotary(q, k, cos, sin)
            if got is None or not all(torch.equal(a, b) for a, b in zip(got, want)):
                logger.info("native rotary embedding differs from the model's (%s): not used", check_dtype)
                return False
    return True


if __name__ == "__main__":  # make setup: build now, so no worker compiles on its first step
    print(native_build.build(SOURCE, FLAGS))

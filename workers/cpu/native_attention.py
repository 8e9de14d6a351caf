"""The CPU decode-attention kernel (``workers/cpu/native/paged_decode.cpp``), built and loaded with ctypes.

Why native: on CPU, decode attention as batched torch products costs the same per KV block
whether a row owns it or not and runs a dozen small ops per layer; the kernel reads only each
row's valid keys, where they lie, in one call per layer. ``workers.cpu.native_build`` compiles it
(``make setup``, or a worker's first use). Where no compiler is found, callers fall back to the
torch path (``available()`` is False).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from workers.cpu import native_build
from workers.cpu.native_build import NativeKernelUnavailable

SOURCE = Path(__file__).with_name("native") / "paged_decode.cpp"
# Reassociation lets dot products reduce as a tree, but never -ffast-math: linked into a shared
# library it sets flush-to-zero for the whole process on load (tests/workers/cpu/test_decode_attention.py).
FLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno",
         "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ABI_VERSION = 5
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
__all__ = ["NativeKernelUnavailable", "available", "build", "load", "paged_decode", "paged_decode_op", "supports",
           "write_kv"]


def library_path() -> Path:
    return native_build.library_path(SOURCE, FLAGS)


def build() -> Path:
    return native_build.build(SOURCE, FLAGS)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    library = ctypes.CDLL(str(build()))
    if library.raysample_abi_version() != ABI_VERSION:
        raise NativeKernelUnavailable(f"{library_path()} has ABI {library.raysample_abi_version()}, expected {ABI_VERSION}")
    fn = library.raysample_paged_decode
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    fn.argtypes = [p, i64, i64, p, ctypes.c_int, p, p, ctypes.c_int, i64, i64, i64, i64, p, i64, p, p, i64, i64,
                   f32, f32, i64, p, ctypes.c_int, ctypes.c_int]
    fn.restype = None
    library.raysample_write_kv.argtypes = [p, i64, i64, p, i64, i64, p, p, p, i64, i64, i64, i64]
    library.raysample_write_kv.restype = None
    return library


def load() -> None:
    """Build and load now; raises ``NativeKernelUnavailable`` with the reason."""
    _library()


def available() -> bool:
    return native_build.loads(load, "native CPU decode attention unavailable, using the torch path")


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in DTYPE_CODES


def check_indices(block_tables: torch.Tensor, token_index: torch.Tensor, query_pos: torch.Tensor,
                  num_blocks: int, num_tokens: int, block_size: int) -> None:
    """The kernel addresses memory with these: out of range would be a crash or a silent wrong read."""
    for name, t in (("block_tables", block_tables), ("token_index", token_index), ("query_pos", query_pos)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 tensor")
    if query_pos.shape != token_index.shape or block_tables.shape[0] != token_index.shape[0]:
        raise ValueError("query_pos, token_index and block_tables do not match")
    if token_index.shape[0] and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks
                                 or int(token_index.min()) < 0 or int(token_index.max()) >= num_tokens
                                 or int(query_pos.max()) >= block_tables.shape[1] * block_size):
        raise ValueError("a block id, token index or query position is out of range")
    if query_pos.shape[1] > 1 and bool(((query_pos[:, 1:] >= 0) & (query_pos[:, :-1] < 0)).any()):
        raise ValueError("padding queries (position -1) must come last in each row")  # the kernel stops at the first


def paged_decode(q_all: torch.Tensor, out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 block_tables: torch.Tensor, token_index: torch.Tensor, query_pos: torch.Tensor, scale: float,
                 softcap: float | None, window: int | None, sinks: torch.Tensor | None,
                 indices_checked: bool = False, prefetch: bool = True) -> None:
    """Write the attention output of every real query into ``out[token_index]``.

    ``q_all`` ``(N, heads, d)`` and ``out`` (contiguous, same shape and dtype) in float32 or
    bfloat16, the model's dtype, so neither is converted around the call; pools
    ``(blocks, kv_heads, block_size, d)``; ``block_tables`` int64 ``(rows, width)``; ``token_index``
    and ``query_pos`` int64 ``(rows, q_len)``, padding queries last with position -1.
    ``indices_checked``: the caller ran ``check_indices`` for this pool and step (the model runner
    does once per step, not once per layer). ``prefetch``: False only to measure what the kernel's
    prefetching saves (``bench/cpu_ops.py``); the output is the same.
    """
    if q_all.dtype not in DTYPE_CODES:
        raise ValueError(f"queries must be float32 or bfloat16, not {q_all.dtype}")
    if q_all.stride(-1) != 1:
        q_all = q_all.contiguous()
    if not (out.is_contiguous() and out.dtype == q_all.dtype):
        raise ValueError(f"out must be a contiguous {q_all.dtype} tensor")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.dtype == v_pool.dtype):
        raise ValueError("K/V pools must be contiguous and of one dtype")
    rows, q_len = token_index.shape
    heads, dim = q_all.shape[1], q_all.shape[2]
    num_blocks, kv_heads, block_size = k_pool.shape[:3]
    if out.shape != q_all.shape:
        raise ValueError(f"out {tuple(out.shape)} does not match the queries {tuple(q_all.shape)}")
    if heads % kv_heads or v_pool.shape != k_pool.shape or k_pool.shape[3] != dim:
        raise ValueError(f"{heads} query heads of {dim} do not fit K/V pools {tuple(k_pool.shape)}")
    if not indices_checked:
        check_indices(block_tables, token_index, query_pos, num_blocks, q_all.shape[0], block_size)
    sink_values = None if sinks is None else sinks.detach().float().contiguous()
    if sink_values is not None and sink_values.numel() != heads:
        raise ValueError(f"{sink_values.numel()} sinks for {heads} heads")
    _library().raysample_paged_decode(
        q_all.data_ptr(), q_all.stride(0), q_all.stride(1), out.data_ptr(), DTYPE_CODES[q_all.dtype],
        k_pool.data_ptr(), v_pool.data_ptr(), DTYPE_CODES[k_pool.dtype], heads, kv_heads, dim, block_size,
        block_tables.data_ptr(), block_tables.shape[1], token_index.data_ptr(), query_pos.data_ptr(), rows, q_len,
        scale, softcap or 0.0, window or 0, None if sink_values is None else sink_values.data_ptr(),
        torch.get_num_threads(), int(prefetch),
    )


@torch.library.custom_op("raysample::paged_decode", mutates_args=())
def paged_decode_op(q_all: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    token_index: torch.Tensor, query_pos: torch.Tensor, scale: float, softcap: Optional[float],
                    window: Optional[int], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """``paged_decode`` as one torch operator that returns its output: ``torch.compile`` traces it as a
    single opaque node, so the compiled fixed-shape step (``workers.model.static_decode``) attends with
    the very kernel the variable-shape forward uses. Every query row must be real (no padding queries)."""
    out = torch.zeros(q_all.shape, dtype=q_all.dtype, device=q_all.device)
    paged_decode(q_all, out, k_pool, v_pool, block_tables.contiguous(), token_index.contiguous(),
                 query_pos.contiguous(), scale, softcap, window, sinks)
    return out


@paged_decode_op.register_fake
def _paged_decode_shape(q_all, k_pool, v_pool, block_tables, token_index, query_pos, scale, softcap, window, sinks):
    return q_all.new_empty(q_all.shape)


def bf16_dot_product() -> bool:
    """Whether bfloat16 queries and pools with a head dim of 32k take the kernel's AVX512-BF16 path
    (its sums added in another order than the float32 path's)."""
    return bool(_library().raysample_bf16_dot_product())


def write_kv(key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``key``/``value`` ``(kv_heads, N, d)`` (any strides but the last) into pool rows ``slots``
    ``(N * kv_heads,)``, token-major, of the pools viewed as ``(rows, d)``: what
    ``index_copy_`` does, for both in one call. Slots must be checked in range by the caller (the
    model runner does, once per step)."""
    kv_heads, tokens, dim = key.shape
    if not (key.dtype == value.dtype == k_pool.dtype == v_pool.dtype and value.shape == key.shape
            and key.stride(2) == value.stride(2) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous()
            and k_pool.shape[-1] == dim and v_pool.shape == k_pool.shape and slots.dtype == torch.int64
            and slots.is_contiguous() and slots.numel() == tokens * kv_heads):
        raise ValueError("write_kv: keys, values, pools and slots do not match")
    _library().raysample_write_kv(key.data_ptr(), key.stride(1), key.stride(0), value.data_ptr(), value.stride(1),
                                  value.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), tokens,
                                  kv_heads, dim, key.element_size())


if __name__ == "__main__":  # make setup: build now, so no worker compiles on its first step
    print(build())

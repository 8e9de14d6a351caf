"""The choices a model runner makes from its settings and its device: the dtype, the KV block size, which
attention serves, and how a tensor-parallel rank loads its shard."""

from __future__ import annotations

from typing import Any

import torch

from workers.cpu import native_attention
from workers.model.tensor_parallel import check_divisible


def sharded_loading(model_config: Any, size: int) -> dict:
    """``from_pretrained`` arguments that load this rank's shard (none without tensor parallelism)."""
    if size == 1:
        return {}
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    check_divisible(model_config, size)
    if not dist.is_initialized() or dist.get_world_size() != size:
        raise RuntimeError(f"tensor_parallel_size={size}: join the rank's process group first "
                           "(workers.model.tensor_parallel.join_group)")
    return {"distributed_config": DistributedConfig(tp_size=size)}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}") from None


def default_block_size(device: torch.device, native_decode: bool) -> int:
    """16, as vLLM: prefix-cache hits land on 16-token boundaries (a chat template's shared system
    prompt is often 20-30 tokens). 64 for CPU decode attention in torch, which reads whole blocks
    and pays for many tiny products more than for the padding of larger ones."""
    return 64 if device.type == "cpu" and not native_decode else 16


def use_flex_attention(choice: str, device: torch.device) -> bool:
    """Whether every step's attention runs in FlexAttention (``workers.model.flex_paged``): ``auto`` on CUDA."""
    return choice == "flex" or (choice == "auto" and device.type == "cuda")


def use_native_decode(choice: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention runs in the C++ CPU kernel: ``auto`` where it applies and builds."""
    if choice in ("torch", "flex"):
        return False
    if choice not in ("auto", "native"):
        raise ValueError(f"decode_attention must be auto, native, flex or torch, got {choice!r}")
    if not native_attention.supports(device, dtype):
        if choice == "native":
            raise ValueError(f"decode_attention=native runs on CPU with float32 or bfloat16, not {device.type} "
                             f"with {dtype}; use auto or torch")
        return False
    if choice == "native":
        native_attention.load()  # raises NativeKernelUnavailable with the compiler's reason
        return True
    return native_attention.available()

"""Every CPU linear call with one fixed row count: a row's bits cannot depend on its batch.

CPU matmul libraries pick their kernel by the row count M, and the kernels add in different orders:
oneDNN's bfloat16 kernel on an Intel AMX Xeon changed at 33 rows (the LM head's at 48, 63, 64, ...),
MKL's float32 GEMM on an AMD EPYC at nearly every count. A row's activations, and so a seeded request's
tokens, then depended on what else ran in its step. Sampling counts to find where a kernel varies (the
start-up probe this replaces) cannot prove anything: it missed a projection on the AMX machine.

So every linear layer of a CPU model is called with exactly ``tile`` rows, always: fewer rows are padded
with zeros, more are split into calls of ``tile`` (the last one padded). Each (shape, dtype) then meets one
kernel, whatever the step: the construction, not a measurement, makes a row's output independent of the
row count. What it still needs of the kernel is that, at that one count, a row's bits do not depend on its
position among the ``tile`` rows or on the other rows' values; every kernel measured here has that (the
AMX Xeon's too, at T = 16 and 32), and it is checked once per (shape, dtype, CPU) when a model loads: a
kernel that fails it runs one real row per call instead (correct, slow, and said in one line).

Short calls: a step of 1 row padded to 64 costs a 64-row forward (one float32 request ran at 7 tokens/s on 2
cores where the kernels as they are give 20: ``bench/e2e.py --against invariance-off --requests 1``). So a
call with fewer than ``tile`` rows (or a long call's last part) may take a smaller size from a fixed ladder,
the multiples of ``model.cpu_smallest_row_tile`` below the tile (8, 16, ..., 56), but only a size whose
kernel gives every row the bits the tile's gives it, at any place in the call: checked once per (shape,
dtype, size, CPU) like the tile's own property, and a size that fails is never used (AMX's bfloat16 kernel
changes below 23-33 rows: there the ladder shrinks to the sizes that agree). The call sizes are fixed by
settings, not by the batch; the check only removes sizes.

The tile is a setting (``model.cpu_row_tile``), not a measurement, so every process of every run computes
the same bits; its default was chosen by measured speed (``bench/e2e.py --against invariance-off``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from workers.cpu.cpu_linear import PrepackedLinear
from workers.host_cache import one_maker

logger = logging.getLogger(__name__)

Compute = Callable[[torch.Tensor], torch.Tensor]  # [M, in_features] -> [M, out_features]

DEFAULT_TILE = 64
DEFAULT_SMALLEST = 8  # below about 8 rows a call costs what 8 rows cost here (the weights' reading dominates)


def in_tiles(compute: Compute, rows: torch.Tensor, tile: int, one_per_call: bool = False,
             smaller: tuple[int, ...] = ()) -> torch.Tensor:
    """``compute(rows)`` with every call of ``compute`` exactly ``tile`` rows (split, the last part padded with
    zeros) or, for a last part that fits one, the smallest of the ``smaller`` sizes (ascending, each checked to
    give a row the tile's bits: ``agrees_with_tile``). ``one_per_call``: each real row alone in a call of
    ``tile`` (at the first position), for a kernel whose rows are not independent of their place in a call."""
    count = rows.shape[0]
    if count == tile and not one_per_call:
        return compute(rows)
    step = 1 if one_per_call else tile
    outputs = []
    for start in range(0, count, step):
        part = rows[start:start + step]
        real = part.shape[0]
        size = tile if one_per_call else next((s for s in smaller if s >= real), tile)
        if real < size:
            part = torch.cat([part, part.new_zeros(size - real, part.shape[1])])
        outputs.append(compute(part)[:real] if real < size else compute(part))
    if not outputs:
        return compute(rows.new_zeros(smaller[0] if smaller else tile, rows.shape[1]))[:0]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def ladder(tile: int, smallest: int) -> tuple[int, ...]:
    """The call sizes below ``tile`` a short call may take, ascending: the multiples of ``smallest`` below the
    tile, so a call pads fewer than ``smallest`` rows (powers of two padded 38 rows to 64)."""
    smallest = max(1, smallest)
    return tuple(range(smallest, tile, smallest))


def kernel_of(module: nn.Module) -> Compute | None:
    """The module's own matmul (no hooks); None for a module that is not a CPU linear."""
    if isinstance(module, PrepackedLinear):
        return module.compute
    if type(module) is nn.Linear:
        return lambda x: F.linear(x, module.weight, module.bias)
    return None


@torch.inference_mode()
def rows_independent(compute: Compute, in_features: int, dtype: torch.dtype, tile: int) -> bool:
    """Whether, in a call of ``tile`` rows, each row's bits depend only on that row: the rows rolled by a few
    offsets come out rolled, and other rows' values (zeros, or other random rows) change nothing."""
    generator = torch.Generator().manual_seed(2026)
    x = (torch.randn(tile, in_features, generator=generator) * 3).to(dtype)
    base = compute(x)
    for shift in {1, tile // 2, tile - 1} - {0, tile}:
        if not torch.equal(compute(x.roll(shift, 0)).roll(-shift, 0), base):
            return False
    alone = torch.cat([x[:1], x.new_zeros(tile - 1, in_features)])
    return torch.equal(compute(alone)[0], base[0])


@torch.inference_mode()
def agrees_with_tile(compute: Compute, in_features: int, dtype: torch.dtype, tile: int, size: int) -> bool:
    """Whether calls of ``size`` rows give every row the bits a call of ``tile`` rows gives it: the tile's rows
    in calls of ``size`` (the last one padded), rolled within a call, and alone with zeros."""
    generator = torch.Generator().manual_seed(2027)
    x = (torch.randn(tile, in_features, generator=generator) * 3).to(dtype)
    base = compute(x)
    pieces = []
    for part in x.split(size):
        padded = torch.cat([part, part.new_zeros(size - part.shape[0], in_features)])
        pieces.append(compute(padded)[:part.shape[0]])
    if not torch.equal(torch.cat(pieces), base):
        return False
    if size > 1 and not torch.equal(compute(x[:size].roll(1, 0)).roll(-1, 0), base[:size]):
        return False
    alone = torch.cat([x[:1], x.new_zeros(size - 1, in_features)])
    return torch.equal(compute(alone)[0], base[0])


def _verdict_key(shape: tuple, tile: int) -> str:
    """What decides a verdict: the layer's shape and dtype, the tile, the CPU, torch, the kernel settings,
    the thread count and this code."""
    import hashlib
    import platform

    from workers.cpu.native_build import _cpu_signature

    settings = [(name, os.environ.get(name)) for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                                                          "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")]
    digest = hashlib.sha256()
    for part in (repr(shape), tile, torch.__version__, platform.machine(), _cpu_signature(), repr(settings),
                 torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), Path(__file__).read_bytes(),
                 (Path(__file__).parent / "cpu_linear.py").read_bytes()):
        digest.update(part if isinstance(part, bytes) else repr(part).encode())
    return digest.hexdigest()[:32]


def _checked(store: Path | None, key: str, check: Callable[[], bool]) -> bool:
    """The verdict kept for ``key`` (a JSON ``true``/``false``: anything else is checked again), else ``check``'s."""
    path = store / f"{key}.json" if store is not None else None
    if path is None:
        return check()

    def read() -> bool | None:
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, bool) else None

    saved = read()
    if saved is not None:
        return saved
    with one_maker(path):
        saved = read()
        if saved is not None:
            return saved
        verdict = check()
        try:
            staging = path.with_suffix(f".{os.getpid()}.tmp")
            staging.write_text(json.dumps(verdict))
            staging.replace(path)
        except OSError:
            pass  # an unwritable cache only means checking again next time
    return verdict


def checked_once(store: Path | None, shape: tuple, check: Callable[[], bool], tile: int = DEFAULT_TILE) -> bool:
    """A kernel's verdict for ``shape`` on this CPU (and torch, settings, threads), computed once and kept in
    ``store``: what other exact constructions check as the row tiles do (``workers.model.lora``)."""
    return _checked(store, _verdict_key(shape, tile), check)


def fix_row_counts(model: nn.Module, tile: int = DEFAULT_TILE, store: Path | None = None,
                   smallest: int | None = None) -> dict[str, int]:
    """Run every CPU linear of ``model`` (prepacked or plain) in calls of exactly ``tile`` rows, or of the
    ``ladder(tile, smallest)`` sizes its kernel agrees at (``smallest`` None: the tile alone); returns, by
    module name, the rows each call of it computes for real (``tile``, or 1 where the kernel's rows were not
    independent within a call). Each module's usable sizes are its ``row_sizes``."""
    if tile < 1:
        raise ValueError(f"model.cpu_row_tile must be at least 1, got {tile}")
    verdicts: dict[tuple, tuple[bool, tuple[int, ...]]] = {}
    installed: dict[str, int] = {}
    for name, module in model.named_modules():
        compute = kernel_of(module)
        if compute is None:
            continue
        weight = module.weight if type(module) is nn.Linear else module.packed_weight
        if weight.device.type != "cpu":
            continue
        dtype = module.weight.dtype if type(module) is nn.Linear else module.weight_dtype
        shape = (type(module).__name__, module.in_features, module.out_features, module.bias is None, str(dtype), tile)
        if shape not in verdicts:
            verdicts[shape] = _verdicts(store, shape, compute, module.in_features, dtype, tile,
                                        ladder(tile, smallest) if smallest is not None else ())
        independent, smaller = verdicts[shape]
        _install(module, compute, tile, one_per_call=not independent, smaller=smaller)
        installed[name] = tile if independent else 1
    return installed


def _verdicts(store: Path | None, shape: tuple, compute: Compute, width: int, dtype: torch.dtype, tile: int,
              sizes: tuple[int, ...]) -> tuple[bool, tuple[int, ...]]:
    """Whether the tile's rows are independent in a call, and the sizes below it that agree with it."""
    independent = _checked(store, _verdict_key(shape, tile), lambda: rows_independent(compute, width, dtype, tile))
    if not independent:
        logger.warning("linear %s x %s (%s): a row's bits depend on its place in a call of %d rows on this CPU; it "
                       "runs one real row per call (slow)", shape[1], shape[2], dtype, tile)
        return False, ()
    smaller = tuple(size for size in sizes
                    if _checked(store, _verdict_key((*shape, "size", size), tile),
                                lambda size=size: agrees_with_tile(compute, width, dtype, tile, size)))
    return True, smaller


def _install(module: nn.Module, compute: Compute, tile: int, one_per_call: bool, smaller: tuple[int, ...]) -> None:
    width = module.in_features

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, width)
        return in_tiles(compute, flat, tile, one_per_call, smaller).view(*x.shape[:-1], -1)

    module.forward = MethodType(forward, module)
    module.row_tile = tile
    module.row_sizes = (*smaller, tile) if not one_per_call else (tile,)

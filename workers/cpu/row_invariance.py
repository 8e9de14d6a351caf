"""Each row of a linear layer gets the same bits however many rows share its matmul.

A seeded request's tokens must not depend on its batch. That needs every activation of a row, and
its logits, to be the same bits whether the matmul holds 1 row or 100. CPU BLAS libraries pick a
kernel by the row count, and the kernels add in different orders: on an Intel AMX Xeon, oneDNN's
bfloat16 kernel changes at 33 rows (LM-head shapes also at 48, 63, 64, 65, 100, 128); MKL's float32
GEMM (``torch.nn.functional.linear`` on an AMD EPYC) gives a row other bits at almost every count.

So each linear shape of a loaded model is probed at start-up, on its own kernel, over the row counts
a step can give it (every count up to a decode step's rows, then around each power of two, up to the
most rows it can see). Where some row's output changes with the count, the layer is run only in row counts that the
probe found to agree, a ``RowWindow``: fewer rows are padded with zeros, more are split into windows.
A row then meets the same kernel at any count, by construction (one row at a time always qualifies).
The probe also checks that a row's bits do not depend on its position within a call. Verdicts are
kept per host, keyed by the CPU, torch and this code, so a later start reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from workers.cpu.cpu_linear import PrepackedLinear
from workers.host_cache import one_maker

logger = logging.getLogger(__name__)

Compute = Callable[[torch.Tensor], torch.Tensor]  # [M, in_features] -> [M, out_features]

_WINDOW_TOPS = (64, 32, 16, 8)  # narrower spans split a prefill too finely: a fixed count does better
# A fixed count pads every smaller call up to it and splits a larger one: the one nearest a step's
# decode rows is tried first (padding a few rows to 64 wastes work; splitting 64 into 16s re-reads weights).
_FIXED_COUNTS = (64, 32, 16, 8, 4, 2)
_KEPT_HEAD, _KEPT_TAIL = 16, 4  # rows of each probed count kept for comparison: the first ones and the last ones


@dataclass(frozen=True)
class RowWindow:
    """The row counts a layer's kernel is called with: fewer rows are padded up to ``low``, more are
    split into calls of ``high`` rows (the last one padded up to ``low``)."""

    low: int
    high: int


def probe_counts(limit: int, every_to: int = 16) -> list[int]:
    """Row counts to try, ascending: every one to ``every_to`` (a decode step's rows; at least 16), then
    each power of two, one below and above it and halfway to the next (where kernels change blocking),
    and ``limit`` itself."""
    counts = set(range(1, min(limit, max(16, every_to)) + 1))
    power = 16
    while power <= limit:
        counts.update(c for c in (power - 1, power, power + 1, power + power // 2) if c <= limit)
        power *= 2
    counts.add(limit)
    return sorted(counts)


def _candidates(limit: int, decode_rows: int) -> list[tuple[int, int]]:
    """Windows to try, best first: the widest that pads nothing, then fixed counts: the smallest that holds
    ``decode_rows``, the larger ones, then the smaller ones."""
    spans = [(low, high) for high in _WINDOW_TOPS for low in (1, 2) if high <= limit]
    counts = [c for c in _FIXED_COUNTS if c <= limit]
    fixed = sorted(c for c in counts if c >= decode_rows) + sorted((c for c in counts if c < decode_rows), reverse=True)
    return spans + [(count, count) for count in fixed]


def run_in_window(compute: Compute, rows: torch.Tensor, window: RowWindow) -> torch.Tensor:
    """``compute(rows)`` with every call of ``compute`` inside ``window``."""
    count = rows.shape[0]
    if window.low <= count <= window.high:
        return compute(rows)
    outputs = []
    for start in range(0, count, window.high):
        part = rows[start:start + window.high]
        real = part.shape[0]
        if real < window.low:
            part = torch.cat([part, part.new_zeros(window.low - real, part.shape[1])])
        outputs.append(compute(part)[:real])
    return torch.cat(outputs)


class _Outputs:
    """The rows kept of each probed count (row index -> output), and the first bits seen of each row."""

    def __init__(self) -> None:
        self.by_count: dict[int, dict[int, torch.Tensor]] = {}
        self.first: dict[int, torch.Tensor] = {}

    def add(self, count: int, out: torch.Tensor) -> bool:
        """Keep this count's rows; whether each agrees with the same row at the counts added before."""
        keep = set(range(min(count, _KEPT_HEAD))) | set(range(max(0, count - _KEPT_TAIL), count))
        self.by_count[count] = {i: out[i].clone() for i in keep}
        same = True
        for i, row in self.by_count[count].items():
            seen = self.first.setdefault(i, row)
            same = same and (seen is row or torch.equal(seen, row))
        return same

    def agree(self, counts: list[int]) -> bool:
        """Whether every kept row has the same bits at each of ``counts`` that holds it."""
        first: dict[int, torch.Tensor] = {}
        for count in counts:
            for i, row in self.by_count[count].items():
                if i not in first:
                    first[i] = row
                elif not torch.equal(first[i], row):
                    return False
        return True


def _position_free(compute: Compute, x: torch.Tensor, count: int) -> bool:
    """Whether a call of ``count`` rows gives a row the same bits at every position: the rows rolled
    by a few offsets come out rolled, bit for bit."""
    rows = x[:count]
    base = compute(rows)
    for shift in {1, count // 2, count - 1} - {0, count}:
        if not torch.equal(compute(rows.roll(shift, 0)).roll(-shift, 0), base):
            return False
    return True


@torch.inference_mode()
def find_window(compute: Compute, in_features: int, dtype: torch.dtype, device: torch.device,
                limit: int, decode_rows: int = 16) -> RowWindow | None:
    """None where ``compute`` gives each row the same bits at every probed count up to ``limit`` and
    at every position; else the widest window of counts found to agree (one row at a time, if no wider one).
    ``decode_rows``: the most rows a decode step samples: every count up to it is probed, and a fixed
    count is chosen to hold it."""
    counts = probe_counts(limit, decode_rows)
    generator = torch.Generator().manual_seed(2025)
    x = (torch.randn(limit, in_features, generator=generator) * 3).to(dtype=dtype, device=device)
    outputs = _Outputs()
    varies = False
    for count in counts:
        if varies and count > _WINDOW_TOPS[0]:
            break  # the counts past the widest window are only needed to clear the layer as it is
        varies = not outputs.add(count, compute(x[:count])) or varies
    if not varies and _position_free(compute, x, limit):
        return None
    for low, high in _candidates(limit, decode_rows):
        inside = [c for c in counts if low <= c <= high]
        if not outputs.agree(inside):
            continue
        if high > 1 and not (_position_free(compute, x, high) and _position_free(compute, x, low)):
            continue
        if low > 1 and not torch.equal(  # padding rows must not change the real one
                run_in_window(compute, x[:1], RowWindow(low, high))[0], outputs.by_count[low][0]):
            continue
        return RowWindow(low, high)
    return RowWindow(1, 1)


def _kernel(module: nn.Module) -> Compute | None:
    """The module's own matmul, without its hooks; None for a module that is not a CPU linear."""
    if isinstance(module, PrepackedLinear):
        return module.compute
    if type(module) is nn.Linear:
        return lambda x: F.linear(x, module.weight, module.bias)
    return None


def _install(module: nn.Module, window: RowWindow) -> None:
    compute = _kernel(module)
    assert compute is not None
    width = module.in_features

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, width)
        return run_in_window(compute, flat, window).view(*x.shape[:-1], -1)

    module.forward = MethodType(forward, module)


# Settings that change which kernel a library picks, besides the CPU itself.
_KERNEL_SETTINGS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                    "MKL_CBWR")


def _host_key(shape: tuple) -> str:
    """What decides a verdict: the layer's shape, the CPU, torch, the kernel settings, the thread count
    (a library may split a sum across threads) and this code."""
    from workers.cpu.native_build import _cpu_signature

    digest = hashlib.sha256()
    settings = [(name, os.environ.get(name)) for name in _KERNEL_SETTINGS]
    for part in (repr(shape), torch.__version__, platform.machine(), _cpu_signature(), repr(settings),
                 torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), Path(__file__).read_bytes(),
                 (Path(__file__).parent / "cpu_linear.py").read_bytes()):
        digest.update(part if isinstance(part, bytes) else repr(part).encode())
    return digest.hexdigest()[:32]


def _stored(store: Path | None, key: str, find: Callable[[], RowWindow | None], limit: int) -> RowWindow | None:
    """The verdict saved for ``key``, else ``find``'s, saved. One process probes a key at a time: the
    workers of an engine start together, and a worker that waited reads the verdict its sibling saved.
    A saved verdict outside what ``find`` can return (``limit``: the most rows probed) is probed again."""
    path = store / f"{key}.json" if store is not None else None
    if path is None:
        return find()
    saved = _read_verdict(path, limit)
    if saved is not None:
        return saved[0]
    with one_maker(path):
        saved = _read_verdict(path, limit, quiet=True)  # said above, if it was damaged
        if saved is not None:
            return saved[0]
        window = find()
        try:
            staging = path.with_suffix(f".{os.getpid()}.tmp")  # whole or absent
            staging.write_text(json.dumps(None if window is None else {"low": window.low, "high": window.high}))
            staging.replace(path)
        except OSError:
            pass  # an unwritable cache only means probing again next time
    return window


def _read_verdict(path: Path, limit: int, quiet: bool = False) -> tuple[RowWindow | None] | None:
    """``(window,)`` as saved (the window may be None: no window needed), or None when there is none or
    it is not one ``find_window`` could have given (``null``, or integers 1 <= low <= high <= limit): a
    damaged or edited verdict is probed again, never used (a window of 0 rows failed every forward, one of
    300,000 padded every call to that many rows)."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        saved = ...
    if saved is None:
        return (None,)
    if isinstance(saved, dict) and set(saved) == {"low", "high"} and valid_window(saved["low"], saved["high"], limit):
        return (RowWindow(saved["low"], saved["high"]),)
    if not quiet:
        logger.warning("row-probe verdict %s is not a valid window (%.80r); probing again", path, saved)
    return None


def valid_window(low: object, high: object, limit: int) -> bool:
    """Whether (low, high) is a window of row counts a layer probed up to ``limit`` rows can run in."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)):
        return False
    return 1 <= low <= high <= limit


def _bucket(rows: int) -> int:
    """``rows`` up to a power of two (16 at least): configurations of nearby sizes share one verdict,
    probed over a few more counts than either needs."""
    return max(16, 1 << (max(1, rows) - 1).bit_length())


def make_rows_independent(model: nn.Module, max_tokens: int, max_logit_rows: int,
                          store: Path | None = None) -> dict[str, RowWindow]:
    """Probe every CPU linear of ``model`` (prepacked or plain) and run the ones whose rows depend on
    the row count in a window; returns the windows installed, by module name.

    ``max_tokens``: the most rows a layer inside the model sees (a step's token budget);
    ``max_logit_rows``: the most the output embedding (LM head) sees, one per row that samples. Both
    are rounded up to a power of two, so that nearby configurations share their verdicts.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    verdicts: dict[tuple, RowWindow | None] = {}
    installed: dict[str, RowWindow] = {}
    for name, module in model.named_modules():
        compute = _kernel(module)
        if compute is None:
            continue
        weight = module.weight if type(module) is nn.Linear else module.packed_weight
        if weight.device.type != "cpu":
            continue
        dtype = module.weight.dtype if type(module) is nn.Linear else module.weight_dtype
        decode_rows = _bucket(max_logit_rows)
        limit = _bucket(max_logit_rows if module is head else max(max_tokens, max_logit_rows))
        key = (type(module).__name__, module.in_features, module.out_features, module.bias is None, str(dtype), limit,
               decode_rows)
        if key not in verdicts:
            verdicts[key] = _stored(store, _host_key(key),
                                    lambda: find_window(compute, module.in_features, dtype, weight.device, limit,
                                                        decode_rows=decode_rows), limit)
        window = verdicts[key]
        if window is not None:
            _install(module, window)
            installed[name] = window
    if installed:
        shapes = sorted({(k[1], k[2], str(w)) for k, w in verdicts.items() if w is not None})
        logger.info("%d linear layer(s) run in fixed row counts so a row's output does not depend on its batch: %s",
                    len(installed), shapes)
    return installed

"""Refuse, at load, a model whose attention the paged runner does not reproduce.

A probe runs a short sequence through the paged runner (two prefill chunks and a
decode step) and through transformers' eager attention (and sdpa), and compares the
logits: in float32 to rounding; in a lower precision against a float32 copy of the
same weights, next to the spread of transformers' own attentions. A model that fails
is refused with one line; nothing is served wrongly.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch

from workers.model.paged_attention import ATTENTION_NAME, PagedKVCache, UnsupportedAttention
from workers.host_cache import cache_root, one_maker
from workers.model.tensor_parallel import agree_all, in_a_group
from workers.row_work import RowWork

logger = logging.getLogger(__name__)


class ProbedRunner(Protocol):
    """What the probe uses of ``workers.model.model_runner.ModelRunner``."""

    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    block_size: int
    native_decode: bool
    num_layers: int
    kv_heads: int
    head_dim: int
    num_blocks: int
    cache: PagedKVCache | None

    def forward(self, rows: list[RowWork]) -> torch.Tensor: ...


def _probe_tokens(runner: ProbedRunner) -> list[int]:
    length = max(2, min(3 * runner.block_size + 5, runner.max_model_len - 1))
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, runner.vocab_size, (length,), generator=generator).tolist()


_PROBED_SOURCES = ("model/model_runner.py", "model/model_support.py", "model/attention_probe.py", "row_work.py",
                   "model/paged_attention.py", "cpu/native_attention.py", "model/decode_layout.py",
                   "cpu/native/paged_decode.cpp", "model/tensor_parallel.py", "cpu/cpu_fusion.py", "cpu/exact_ops.py",
                   "cpu/native/exact_ops.cpp", "cpu/native/bfloat16.h")


def probe_key(runner: ProbedRunner, model_path: str | Path, trust_remote_code: bool) -> str | None:
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
    here = Path(__file__).resolve().parents[1]  # workers/
    for name in _PROBED_SOURCES:
        source = here / name
        digest.update(source.read_bytes() if source.is_file() else b"-")
    layout = (torch.__version__, transformers.__version__, runner.device.type, str(runner.dtype), runner.block_size,
              runner.max_model_len, runner.native_decode, len(_probe_tokens(runner)), runner.kv_heads)
    digest.update(repr(layout).encode())
    return digest.hexdigest()[:32]


def verify_once(runner: ProbedRunner, model_path: str | Path, trust_remote_code: bool = False) -> None:
    """``verify_against_eager``, skipped when this exact model, code and layout passed it before on this
    host (a marker in the raysample cache); each worker otherwise spends seconds on it at every start."""
    key = probe_key(runner, model_path, trust_remote_code)
    marker = cache_root() / "probes" / key if key is not None else None
    # Workers that start together on a host that has no marker yet probe one at a time: the others
    # then find the marker. Not the ranks of a tensor-parallel group: they probe together (the
    # forwards' collectives must meet), all skip or none does, whatever another group wrote meanwhile.
    solo = marker is not None and not in_a_group()
    if solo and _passed(marker, key):
        return
    with one_maker(marker) if solo else nullcontext():
        if agree_all(marker is not None and _passed(marker, key)):
            return
        verify_against_eager(runner)
        if marker is not None:
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                staging = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")  # whole or absent
                staging.write_text(f"{key}\n{type(runner.model).__name__} passed the paged-attention probe\n")
                staging.replace(marker)
            except OSError:
                pass  # an unwritable cache only means probing again next time


def _passed(marker: Path | None, key: str | None) -> bool:
    """Whether ``marker`` says this key passed: its first line is the key (a damaged or foreign file does not)."""
    if marker is None:
        return False
    try:
        return marker.read_text().split("\n", 1)[0] == key
    except (OSError, UnicodeDecodeError):
        return False


# Float32: the paged path computes what eager attention computes, to rounding.
FLOAT32_TOLERANCE = 1e-4
# A lower precision rounds differently in every attention implementation: there the paged path may
# be at most this many times as far from the float32 reference as transformers' own attentions are
# (eager, and sdpa where the model has it), plus a floor for tiny models whose spread is near zero.
SPREAD_FACTOR = 2.0
LOW_PRECISION_FLOOR = 5e-3


@torch.inference_mode()
def verify_against_eager(runner: ProbedRunner) -> None:
    """Refuse (``UnsupportedAttention``) a model whose paged logits are not eager attention's.

    Two stages. First the algorithm, in float32 (on a float32 copy of the weights when the model
    runs in a lower precision): paged vs eager within ``FLOAT32_TOLERANCE``, so a wrong mask,
    position or scale is caught whatever the dtype. Then the model's own dtype: bfloat16 and
    float16 round differently in every implementation (on SmolLM2-135M in bfloat16, transformers'
    eager and sdpa differ by 1.2 in the logits), so the paged logits may be at most
    ``SPREAD_FACTOR`` times as far from the float32 reference as eager's and sdpa's are.
    """
    arch = type(runner.model).__name__
    tokens = _probe_tokens(runner)
    float32 = runner.dtype == torch.float32
    reference = None
    if float32 or _float32_copy_fits(runner):
        with _in_float32(runner):
            paged32 = _paged_logits(runner, tokens)
            reference = _transformers_logits(runner, tokens, "eager")
        _check(arch, tokens, "eager attention in float32", float(_distance(paged32, reference)),
               FLOAT32_TOLERANCE * _scale(reference))
        if float32:
            return
    else:
        logger.warning("%s: no room for a float32 copy of the weights; the attention probe compares in %s only",
                       arch, runner.dtype)
    paged = _paged_logits(runner, tokens)
    own = {"eager": _transformers_logits(runner, tokens, "eager")}
    try:
        own["sdpa"] = _transformers_logits(runner, tokens, "sdpa")
    except (ValueError, ImportError, NotImplementedError):
        pass  # the model has no sdpa path: eager's spread alone
    if reference is None:  # no float32 truth: the spread between transformers' own implementations
        reference = own.pop("eager")
    scale = _scale(reference)
    spread = max((float(_distance(logits, reference)) for logits in own.values()), default=0.0)
    tolerance = SPREAD_FACTOR * spread + LOW_PRECISION_FLOOR * scale
    _check(arch, tokens, f"eager attention (in {runner.dtype}, where transformers' own attentions differ by "
           f"{spread:.3g})", float(_distance(paged, reference)), tolerance)


def _check(arch: str, tokens: list[int], against: str, error: float, tolerance: float) -> None:
    if not error <= tolerance:
        raise UnsupportedAttention(
            f"{arch}: logits on the paged runner differ from {against} by {error:.3g} (tolerance {tolerance:.3g}) "
            f"on a {len(tokens)}-token probe; refusing a model whose attention cannot be reproduced"
        )


def _scale(reference: torch.Tensor) -> float:
    return 1.0 + float(reference.abs().max())


def _distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs().max()


def _probe_rows(tokens: list[int]) -> tuple[int, list[int]]:
    """The probe feeds two prefill chunks, then one decode token: the logits rows it compares."""
    split = len(tokens) // 2
    return split, [split - 1, *range(split, len(tokens))]


def probe_logits(runner: ProbedRunner) -> torch.Tensor:
    """The probe's logits through the paged runner as it runs now (``ModelRunner.self_check``)."""
    with torch.inference_mode():
        return _paged_logits(runner, _probe_tokens(runner))


def _paged_logits(runner: ProbedRunner, tokens: list[int]) -> torch.Tensor:
    """Logits of the probe through the paged runner, on a cache of its own in the runner's dtype."""
    arch = type(runner.model).__name__
    blocks = -(-len(tokens) // runner.block_size)
    table = list(range(blocks))
    split, _ = _probe_rows(tokens)
    saved = runner.cache, runner.num_blocks
    runner.cache = PagedKVCache(runner.num_layers, blocks, runner.block_size, runner.kv_heads, runner.head_dim,
                                runner.dtype, runner.device)
    runner.num_blocks = blocks
    try:
        first = runner.forward([RowWork(table, tokens[:split], 0, 1)])
        rest = runner.forward([RowWork(table, tokens[split:-1], split, len(tokens) - 1 - split)])
        last = runner.forward([RowWork(table, tokens[-1:], len(tokens) - 1, 1, decode=True)])
    except UnsupportedAttention as exc:
        raise UnsupportedAttention(f"{arch}: {exc}") from None
    except Exception as exc:
        raise UnsupportedAttention(f"{arch}: its attention layers do not run on the paged runner ({type(exc).__name__}: {exc})") from None
    finally:
        runner.cache, runner.num_blocks = saved
    called = runner.last_step.layers_called if runner.last_step is not None else set()
    if len(called) != runner.num_layers:
        raise UnsupportedAttention(
            f"{arch}: {runner.num_layers - len(called)} of {runner.num_layers} attention layers do not go through "
            "transformers' AttentionInterface, so the paged KV cache cannot serve them"
        )
    return torch.cat([first, rest, last])


def _transformers_logits(runner: ProbedRunner, tokens: list[int], implementation: str) -> torch.Tensor:
    """The probe's logits from one of transformers' own attention implementations, at the compared rows."""
    model = runner.model
    model.set_attn_implementation(implementation)
    try:
        logits = model(input_ids=torch.tensor([tokens], device=runner.device), use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return logits[_probe_rows(tokens)[1]].float()


def _low_precision_tensors(model: torch.nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """(owner's parameter or buffer dict, name, tensor) of every floating tensor that is not float32."""
    found = []
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float32:
                    found.append((store, name, tensor))
    return found


def _float32_copy_fits(runner: ProbedRunner) -> bool:
    """Whether a float32 copy of the weights fits beside them (the originals are kept, to restore exactly)."""
    unique = {id(t): t for _, _, t in _low_precision_tensors(runner.model)}
    needed = sum(t.numel() for t in unique.values()) * 4
    if runner.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(runner.device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return needed <= 0.8 * free


def _widened(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 copy; a weight prepacked for oneDNN (``workers.cpu.cpu_linear``, bfloat16 where the CPU has
    native bf16) is opaque: unpack it, widen it and pack it again for the float32 kernels."""
    if tensor.is_mkldnn:
        from workers.cpu.cpu_linear import _BATCH_HINT

        return torch.ops.mkldnn._reorder_linear_weight(tensor.to_dense().float(), _BATCH_HINT)
    if hasattr(tensor, "to_local"):  # a tensor-parallel shard (DTensor): widen the local shard in place of it
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(tensor.to_local().float(), tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    return tensor.detach().float()


@contextmanager
def _in_float32(runner: ProbedRunner) -> Iterator[None]:
    """The runner on a float32 copy of its weights; the original tensors (not a cast back) are restored."""
    entries = _low_precision_tensors(runner.model)
    copies: dict[int, torch.Tensor] = {}
    saved_dtype = runner.dtype
    with torch.no_grad():
        for store, name, tensor in entries:
            wide = copies.setdefault(id(tensor), _widened(tensor))
            store[name] = torch.nn.Parameter(wide, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else wide
        runner.dtype = torch.float32
    try:
        yield
    finally:
        for store, name, tensor in entries:
            store[name] = tensor
        runner.dtype = saved_dtype
        copies.clear()
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()

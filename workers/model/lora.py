"""LoRA adapters per request: every adapter of a step applied in two matmuls per projection, whatever mix of
adapters and base rows the step holds (not one forward, nor one product, per adapter).

Each q/k/v/o and gate/up/down projection of the decoder layers is wrapped (``LoraLinear``). The device holds
``lora.max_loras`` slots of ``lora.max_lora_rank`` each: per projection, one stacked ``A`` (slots x rank
rows) and one stacked ``B`` (as many columns), an adapter's weights in its slot, zeros where its rank is
smaller or a slot is empty. A step computes, for all its tokens, ``low = x @ A.T``; keeps in each token's
row only its own slot's columns, times that adapter's scaling (base-model tokens keep none); and adds
``low @ B.T`` to the base projection. Where the base model is alone in a step, nothing runs.

A token's bits must not depend on the other adapters of its step (``model.batch_invariant``): the shapes
never change (every slot is always there), on CPU both products run in the engine's fixed row tiles, and
the adapter's slot does not move its bits: the zeros of other slots add nothing, and that a kernel gives a
slot's columns the same bits in every slot is checked once per shape and CPU (``slots_independent``). A
kernel that fails it computes each slot of the step in products of its own instead (correct, slower).

Adapters load on first use into a free slot, or the least recently used one's (``lora.max_loras``; the
scheduler puts at most that many in a step), and stay on the host for ``lora.max_cpu_loras``.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.lora_files import TARGETS, AdapterError, projection_shapes, read_adapter

logger = logging.getLogger(__name__)

Host = dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module name -> (A [r, in], B [out, r], scaling)
Tiled = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LoraLimits:
    """``lora.max_loras``, ``lora.max_cpu_loras`` and ``lora.max_lora_rank``, for the runner."""

    max_loras: int = 1
    max_cpu_loras: int = 1
    max_lora_rank: int = 16

    def buffer_bytes(self, hf_config: Any, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """Device bytes of the stacked slots of every projection (what the GPU memory plan sets aside)."""
        per_layer = sum(out + inp for out, inp in projection_shapes(hf_config).values())
        layers = getattr(hf_config, "num_hidden_layers", 0)
        return layers * per_layer * self.max_loras * self.max_lora_rank * dtype_bytes // max(1, tensor_parallel_size)


class AdapterUnavailable(RuntimeError):
    """An adapter a step needs cannot be loaded; ``rows``: the step's rows (indices into its work) that use it."""

    def __init__(self, message: str, rows: tuple[int, ...]) -> None:
        super().__init__(message)
        self.rows = rows


class LoraLinear(nn.Module):
    """A projection with the step's adapters added to the tokens that use them."""

    def __init__(self, base: nn.Module, name: str, manager: LoraManager) -> None:
        super().__init__()
        self.base = base
        self.lora_name = name
        self.__dict__["manager"] = manager  # not a submodule
        self.in_features = getattr(base, "in_features", None)
        self.out_features = getattr(base, "out_features", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        return self.manager.add_deltas(self.lora_name, x, out)


@dataclass
class Stacked:
    """One projection's slots on the device: A ``[slots * rank, in]``, B ``[out, slots * rank]``, scalings."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: torch.Tensor  # [slots]
    split_input: bool  # a tensor-parallel shard of the input: ``low`` is summed over the ranks


class LoraManager:
    """The adapter slots of one model replica, and which slot each token of the step uses."""

    def __init__(self, model: nn.Module, hf_config: Any, dtype: torch.dtype, device: torch.device,
                 limits: LoraLimits, tiled: Tiled | None = None, per_slot: bool = False) -> None:
        """``tiled(compute, rows)``: run a product in the engine's fixed row counts (CPU); None: as it is.
        ``per_slot``: each slot in products of its own (a kernel whose columns move with their slot)."""
        self.hf_config, self.dtype, self.device = hf_config, dtype, device
        self.slots, self.rank = limits.max_loras, limits.max_lora_rank
        self.max_cpu_loras = max(limits.max_cpu_loras, limits.max_loras)
        self.tiled, self.per_slot = tiled, per_slot
        self.in_slot: OrderedDict[tuple[int, str], int] = OrderedDict()  # adapter -> its slot, least recent first
        self.on_host: OrderedDict[tuple[int, str], Host] = OrderedDict()
        self.stacked: dict[str, Stacked] = {}
        self.shards: dict[str, tuple[int, int, int] | None] = {}  # module -> this rank's (dim, start, size)
        self._mask: torch.Tensor | None = None  # [tokens, slots]: 1 where a token uses that slot
        self._used: list[int] = []  # the step's slots
        self.wrapped = self._install(model)

    def check_slots(self, store: Any) -> None:
        """With fixed row tiles (CPU batch invariance): each projection shape's kernel checked once per CPU
        (``slots_independent``, kept in ``store``); one that fails makes every slot run on its own."""
        from pathlib import Path

        from workers.cpu.row_tiles import checked_once

        if self.tiled is None or self.per_slot:
            return
        source = Path(__file__).read_bytes()
        for shape in sorted({(s.a.shape[1], s.b.shape[0]) for s in self.stacked.values()}):
            key = ("lora-slots", *shape, self.slots, self.rank, str(self.dtype), source)
            if not checked_once(store, key, lambda: slots_independent(*shape, self.slots, self.rank, self.dtype,
                                                                      self.tiled)):
                logger.warning("LoRA products of %s x %s (%s): a slot's bits depend on its place on this CPU; each "
                               "slot of a step runs in products of its own (slower)", *shape, self.dtype)
                self.per_slot = True
                return

    def _install(self, model: nn.Module) -> int:
        for name, module in list(model.named_modules()):
            parent_name, _, attr = name.rpartition(".")
            if attr not in TARGETS or not parent_name.startswith("model.layers."):
                continue
            out_local, in_local, split_input, shard = _local_shape(module, name)
            width = self.slots * self.rank
            self.stacked[name] = Stacked(
                a=torch.zeros(width, in_local, dtype=self.dtype, device=self.device),
                b=torch.zeros(out_local, width, dtype=self.dtype, device=self.device),
                scaling=torch.zeros(self.slots, dtype=self.dtype, device=self.device), split_input=split_input)
            self.shards[name] = shard
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, LoraLinear(module, name, self))
        return len(self.stacked)

    # ----- the step -----

    def prepare(self, adapters: Sequence[tuple[int, str] | None], token_counts: Sequence[int]) -> None:
        """This forward's rows: each row's adapter (id, path) or None, and how many tokens it packs (in order).

        An adapter that cannot load fails the rows that use it (``AdapterUnavailable``) before any product
        runs; in a tensor-parallel group every rank agrees first, so all of them raise or none does."""
        self._mask, self._used = None, []
        wanted = list(dict.fromkeys(a for a in adapters if a is not None))
        if not wanted:
            return
        problems, slot_of = [], {}
        for adapter in wanted:
            try:
                slot_of[adapter] = self._slot(adapter, keep=wanted)
            except AdapterError as exc:
                problems.append(str(exc))
        agreed = _agree([adapter in slot_of for adapter in wanted])
        failed = [adapter for adapter, ok in zip(wanted, agreed) if not ok]
        if failed:
            rows = tuple(r for r, a in enumerate(adapters) if a in failed)
            raise AdapterUnavailable("; ".join(problems) or f"LoRA adapter {failed[0][1]} cannot be loaded on "
                                     "another rank of this worker's tensor-parallel group", rows)
        slot_per_token = torch.tensor([-1 if a is None else slot_of[a] for a, n in zip(adapters, token_counts)
                                       for _ in range(n)], dtype=torch.long)
        mask = torch.zeros(len(slot_per_token), self.slots, dtype=self.dtype)
        used = slot_per_token >= 0
        mask[used.nonzero().squeeze(1), slot_per_token[used]] = 1
        self._mask = mask.to(self.device)
        self._used = sorted(set(slot_of.values()))

    def add_deltas(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self._mask is None:
            return out
        stacked = self.stacked[name]
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if flat_x.dtype != self.dtype:
            flat_x = flat_x.to(self.dtype)
        keep = (self._mask * stacked.scaling).repeat_interleave(self.rank, dim=1)  # [tokens, slots * rank]
        if self.per_slot:
            for slot in self._used:
                cols = slice(slot * self.rank, (slot + 1) * self.rank)
                delta = self._delta(flat_x, stacked.a[cols], stacked.b[:, cols], keep[:, cols], stacked.split_input)
                flat_out += delta.to(flat_out.dtype)
            return out
        flat_out += self._delta(flat_x, stacked.a, stacked.b, keep, stacked.split_input).to(flat_out.dtype)
        return out

    def _delta(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor,
               split_input: bool) -> torch.Tensor:
        low = self._product(x, a)
        if split_input:  # this rank holds a slice of the input: the ranks' partial products summed
            import torch.distributed as dist

            dist.all_reduce(low)
        return self._product(low * keep, b)

    def _product(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        compute = lambda part: F.linear(part, weight)  # noqa: E731
        return compute(rows) if self.tiled is None else self.tiled(compute, rows)

    # ----- adapters -----

    def _slot(self, adapter: tuple[int, str], keep: list[tuple[int, str]]) -> int:
        """The adapter's slot, loading it (from the host cache or its files) into a free one, or the least
        recently used one's that this step does not need; ``AdapterError`` if it cannot load."""
        if adapter in self.in_slot:
            self.in_slot.move_to_end(adapter)
            return self.in_slot[adapter]
        host = self.on_host.pop(adapter, None)
        if host is None:
            try:
                host = self._load(adapter[1])
            except Exception as exc:  # noqa: BLE001 - whatever its files do wrong is this adapter's failure alone
                raise AdapterError(f"LoRA adapter {adapter[1]} (id {adapter[0]}) cannot be loaded: "
                                   f"{type(exc).__name__}: {exc}") from None
        self.on_host[adapter] = host
        while len(self.on_host) > self.max_cpu_loras:
            self.on_host.popitem(last=False)
        free = set(range(self.slots)) - set(self.in_slot.values())
        if free:
            slot = min(free)
        else:
            evicted = next((a for a in self.in_slot if a not in keep), None)
            if evicted is None:
                raise AdapterError(f"LoRA adapter {adapter[1]}: more adapters in one step than lora.max_loras="
                                   f"{self.slots}")
            slot = self.in_slot.pop(evicted)
            logger.info("LoRA adapter %s evicted from the device (lora.max_loras=%d)", evicted[1], self.slots)
        self._fill(slot, host)
        self.in_slot[adapter] = slot
        return slot

    def _fill(self, slot: int, host: Host) -> None:
        cols = slice(slot * self.rank, (slot + 1) * self.rank)
        for name, stacked in self.stacked.items():
            stacked.a[cols].zero_()
            stacked.b[:, cols].zero_()
            stacked.scaling[slot] = 0
            found = host.get(name)
            if found is None:
                continue
            a, b, scaling = found
            a, b = self._slices(name, a, b)
            rank = a.shape[0]
            stacked.a[slot * self.rank: slot * self.rank + rank] = a.to(self.device)
            stacked.b[:, slot * self.rank: slot * self.rank + rank] = b.to(self.device)
            stacked.scaling[slot] = scaling

    def _slices(self, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a module's A and B: B's rows where the base splits its output, A's columns
        where it splits its input (whose partial products ``_delta`` sums over the ranks)."""
        shard = self.shards.get(name)
        if shard is not None:
            dim, start, size = shard
            if dim == 0:
                b = b[start:start + size]
            else:
                a = a[:, start:start + size]
        return a, b

    def _load(self, path: str) -> Host:
        from safetensors.torch import load_file

        spec = read_adapter(path, self.hf_config, self.rank)
        tensors = load_file(str(spec.weights), device="cpu")
        weights: Host = {}
        for module, (_, scaling) in spec.modules.items():
            key = f"base_model.model.{module}"
            a = tensors.get(f"{key}.lora_A.weight", tensors.get(f"{module}.lora_A.weight"))
            b = tensors.get(f"{key}.lora_B.weight", tensors.get(f"{module}.lora_B.weight"))
            weights[module] = (a.to(self.dtype), b.to(self.dtype), scaling)
        return weights


def _local_shape(module: nn.Module, name: str) -> tuple[int, int, bool, tuple[int, int, int] | None]:
    """(out, in) of this rank's part of a projection, whether its input is split, and how transformers'
    tensor-parallel plan split its weight here: (dim, start, size), dim 0 the output, 1 the input; None whole."""
    weight = getattr(module, "weight", None)
    out_features, in_features = module.out_features, module.in_features
    placements = getattr(weight, "placements", None)
    if weight is None or placements is None:
        return out_features, in_features, False, None
    from torch.distributed.tensor import Replicate, Shard

    if all(isinstance(p, Replicate) for p in placements):
        return out_features, in_features, False, None
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim not in (0, 1):
        raise ValueError(f"LoRA on {name}: its tensor-parallel placement {placements} is not one LoRA can follow")
    dim = placements[0].dim
    local = weight.to_local().shape
    shard = (dim, weight.device_mesh.get_local_rank() * local[dim], local[dim])
    return (local[0], in_features, False, shard) if dim == 0 else (out_features, local[1], True, shard)


def _agree(flags: list[bool]) -> list[bool]:
    """Each flag and-ed over the ranks of this process's tensor-parallel group (as they are without one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.long)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


@torch.inference_mode()
def slots_independent(in_features: int, out_features: int, slots: int, rank: int, dtype: torch.dtype,
                      tiled: Tiled) -> bool:
    """Whether, at these shapes, a slot's columns come out with the same bits in every slot and whatever the
    other slots hold: ``x @ A.T`` with A's slot rows moved, and ``low @ B.T`` with ``low`` zero outside one
    slot placed in each slot in turn, other slots of B random."""
    if slots == 1:
        return True
    generator = torch.Generator().manual_seed(2027)
    width = slots * rank
    x = (torch.randn(64, in_features, generator=generator) * 3).to(dtype)
    a = (torch.randn(width, in_features, generator=generator) / math.sqrt(in_features)).to(dtype)
    b = (torch.randn(out_features, width, generator=generator) / math.sqrt(rank)).to(dtype)
    low = torch.randn(64, rank, generator=generator).to(dtype)

    def product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return tiled(lambda part: F.linear(part, weight), rows)

    first = product(x, a)[:, :rank]
    wanted = None
    for slot in range(slots):
        moved = a.roll(slot * rank, 0)
        if not torch.equal(product(x, moved)[:, slot * rank:(slot + 1) * rank], first):
            return False
        placed = torch.zeros(64, width, dtype=dtype)
        placed[:, slot * rank:(slot + 1) * rank] = low
        got = product(placed, b.roll(slot * rank, 1))
        if wanted is None:
            wanted = got
        elif not torch.equal(got, wanted):
            return False
    return True

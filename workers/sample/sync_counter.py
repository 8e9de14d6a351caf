"""Counting the reads that make the host wait for the device, so a step can be held to none.

On a GPU, reading a device tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``,
``.cpu()``, ``.numpy()``, a data-dependent shape such as ``nonzero``) waits until the device has
finished everything queued before it: the host can neither plan the next step nor launch the next
graph early. ``SyncCounter`` counts such reads on any device. On CPU, where every tensor lives in host
memory, it tells the tensors a GPU would hold from those it would not by their origin: a tensor made
from host data (``torch.from_numpy``, ``torch.tensor`` of a list, ``torch.as_tensor`` of an array), or
computed from such tensors only, is the host's; moving it to the device is an upload, counted apart;
everything else (the logits, what is computed from them, factories such as ``torch.zeros``) is the
device's. So a step that reads nothing here reads nothing on a GPU. On CUDA
``torch.cuda.set_sync_debug_mode("error")`` can confirm it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# Tensor methods and functions whose result on the host needs the tensor's values.
_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.__repr__: "repr",
    torch.equal: "equal",
}
_HOST_FACTORIES = {torch.from_numpy, torch.tensor, torch.as_tensor}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}


class SyncCounter(TorchFunctionMode):
    """Counts host reads of device tensors while active: ``counts`` by kind, ``total``, and ``where``
    (one line per read); ``uploads`` counts host tensors moved to the device (not reads). A tensor is
    the host's when it was made from host data while a counter was active (``torch.from_numpy`` is
    wrapped for that), or computed from host tensors only; any other tensor is taken to be the device's."""

    _MARK = "_raysample_host_tensor"

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.where: list[str] = []
        self.uploads = 0
        self._from_numpy: Any = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> SyncCounter:
        self._from_numpy = torch.from_numpy
        original, mark = self._from_numpy, self._mark_host

        def from_numpy(array: Any) -> torch.Tensor:  # not a torch function: a mode never sees it
            tensor = original(array)
            mark(tensor)
            return tensor

        torch.from_numpy = from_numpy
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    @classmethod
    def _is_host(cls, tensor: torch.Tensor) -> bool:
        return getattr(tensor, cls._MARK, False)

    @classmethod
    def _mark_host(cls, tensor: torch.Tensor) -> None:
        try:
            setattr(tensor, cls._MARK, True)
        except (AttributeError, RuntimeError):
            pass

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        source_is_host = bool(tensors) and self._is_host(tensors[0])
        moving = func in _MOVES and bool(tensors) and _changes_device(args, kwargs)
        kind = _READS.get(func)
        if moving and not source_is_host and _target(args, kwargs) == "cpu":
            kind = "to(cpu)"  # a device tensor copied to the host (on CPU: a tensor the device would hold)
        if kind is not None and tensors and not source_is_host:
            self.counts[kind] += 1
            self.where.append(f"{kind} of a {tuple(tensors[0].shape)} tensor")
        result = func(*args, **kwargs)
        if moving and source_is_host:
            self.uploads += 1  # a host tensor moved to the device: the result is the device's
            return result
        host_made = func in _HOST_FACTORIES and not (func is torch.as_tensor and tensors)
        if host_made or (tensors and all(self._is_host(t) for t in tensors)):
            for out in tree_flatten(result)[0]:
                if isinstance(out, torch.Tensor):
                    self._mark_host(out)
        return result


def _target(args: tuple, kwargs: dict) -> str | None:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type
    return None


def _changes_device(args: tuple, kwargs: dict) -> bool:
    """A ``.to``/``.cuda`` that names a device (``.to(dtype)`` alone stays where it is)."""
    return _target(args, kwargs) is not None or len(args) == 1

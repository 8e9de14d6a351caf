"""Finding and constructing logits processors: builtins, entry points, classes, FQCNs.

A custom item is a ``LogitsProcessor`` subclass, a ``"pkg.module:Qualified.Name"``
string (``"pkg.module.Name"`` is accepted too), or a ``ProcessorSpec`` carrying
constructor keyword arguments given on top of the standard three.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Union

import torch

from processors.builtin import BUILTIN_LOGITS_PROCESSORS
from processors.interface import LogitsProcessor
from processors.sampling_params import SamplingParams
from processors.state import LogitsProcessors

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "raysample.logits_processors"


class LogitsProcessorLoadError(ValueError):
    """A custom processor item could not be turned into a ``LogitsProcessor`` class."""


@dataclass(frozen=True)
class ProcessorSpec:
    """A processor plus keyword arguments for its constructor (configured once per engine)."""

    processor: str | type[LogitsProcessor]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.processor, repr(sorted(self.kwargs.items(), key=lambda kv: kv[0]))))


CustomProcessor = Union[str, type[LogitsProcessor], ProcessorSpec]


def describe(item: object) -> str:
    if isinstance(item, type):
        return f"{item.__module__}:{item.__qualname__}"
    if isinstance(item, ProcessorSpec):
        return describe(item.processor)
    return repr(item)


def _check_class(obj: object, item: object) -> type[LogitsProcessor]:
    if not isinstance(obj, type):
        raise LogitsProcessorLoadError(
            f"Logits processor {describe(item)} is not a class (it is a {type(obj).__name__})."
        )
    if not issubclass(obj, LogitsProcessor):
        raise LogitsProcessorLoadError(
            f"Logits processor {describe(item)} is not a subclass of processors.LogitsProcessor."
        )
    return obj


def resolve_fqcn(name: str) -> type[LogitsProcessor]:
    """Import ``"pkg.module:Qualified.Name"`` and check it is a processor class."""
    if not isinstance(name, str) or not name.strip():
        raise LogitsProcessorLoadError(f"Logits processor name must be a non-empty string, got {name!r}.")
    if ":" in name:
        module_path, _, qualname = name.partition(":")
    else:
        module_path, _, qualname = name.rpartition(".")
    if not module_path or not qualname or ":" in qualname:
        raise LogitsProcessorLoadError(
            f"Logits processor {name!r} is not a fully qualified class name; expected 'pkg.module:ClassName'."
        )
    try:
        obj: Any = importlib.import_module(module_path)
    except Exception as exc:
        raise LogitsProcessorLoadError(
            f"Logits processor {name!r}: module {module_path!r} could not be imported ({type(exc).__name__}: {exc})."
        ) from exc
    for attr in qualname.split("."):
        if not hasattr(obj, attr):
            raise LogitsProcessorLoadError(
                f"Logits processor {name!r}: {getattr(obj, '__name__', module_path)!r} has no attribute {attr!r}."
            )
        obj = getattr(obj, attr)
    return _check_class(obj, name)


def resolve(item: CustomProcessor) -> tuple[type[LogitsProcessor], dict[str, Any]]:
    """One custom item -> (class, constructor kwargs)."""
    if isinstance(item, ProcessorSpec):
        cls, _ = resolve(item.processor)
        if not isinstance(item.kwargs, dict):
            raise LogitsProcessorLoadError(f"Logits processor {describe(item)}: kwargs must be a mapping.")
        return cls, dict(item.kwargs)
    if isinstance(item, str):
        return resolve_fqcn(item), {}
    return _check_class(item, item), {}


def load_entry_point_processors(group: str = ENTRY_POINT_GROUP) -> list[type[LogitsProcessor]]:
    """Every class installed under the entry-point group (all of them, always, as vLLM)."""
    classes = []
    for entry_point in importlib.metadata.entry_points(group=group):
        try:
            obj = entry_point.load()
        except Exception as exc:
            raise LogitsProcessorLoadError(
                f"Logits processor entry point {entry_point.name!r} = {entry_point.value!r} (group {group!r}) "
                f"could not be loaded ({type(exc).__name__}: {exc})."
            ) from exc
        classes.append(_check_class(obj, f"entry point {entry_point.name!r} = {entry_point.value!r}"))
    return classes


def load_custom_processors(
    custom: Iterable[CustomProcessor] = (),
) -> list[tuple[type[LogitsProcessor], dict[str, Any]]]:
    """Entry-point classes, then the given items; exact repeats are constructed once."""
    seen: set[tuple[type, tuple]] = set()
    out = []
    items = [(cls, {}) for cls in load_entry_point_processors()] + [resolve(item) for item in custom]
    for cls, kwargs in items:
        key = (cls, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key in seen:
            logger.info("Logits processor %s listed more than once; loading it once.", describe(cls))
            continue
        seen.add(key)
        out.append((cls, kwargs))
    return out


def build_logitsprocs(
    config: Any,
    device: torch.device | str,
    is_pin_memory: bool,
    custom: Sequence[CustomProcessor] = (),
) -> LogitsProcessors:
    """Instantiate builtins, entry-point processors and ``custom`` items, in that order."""
    device = torch.device(device)
    procs: list[LogitsProcessor] = [cls(config, device, is_pin_memory) for cls in BUILTIN_LOGITS_PROCESSORS]
    for cls, kwargs in load_custom_processors(custom):
        try:
            procs.append(cls(config, device, is_pin_memory, **kwargs))
        except Exception as exc:
            raise LogitsProcessorLoadError(
                f"Logits processor {describe(cls)} failed in its constructor ({type(exc).__name__}: {exc})."
            ) from exc
    return LogitsProcessors(procs)


@lru_cache(maxsize=64)
def _cached_custom_classes(custom: tuple[CustomProcessor, ...]) -> tuple[type[LogitsProcessor], ...]:
    return tuple(cls for cls, _ in load_custom_processors(custom))


def validate_logits_processors_parameters(
    custom: Sequence[CustomProcessor] | None, sampling_params: SamplingParams
) -> None:
    """Run every custom processor class's ``validate_params`` on one request's params."""
    for cls in _cached_custom_classes(tuple(custom or ())):
        cls.validate_params(sampling_params)

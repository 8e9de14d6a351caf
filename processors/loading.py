"""Finding and constructing logits processors: builtins, entry points, classes, FQCNs.

A custom item is a ``LogitsProcessor`` subclass, a ``"pkg.module:Qualified.Name"``
string, or a ``ProcessorSpec`` carrying constructor keyword arguments given on
top of the standard three. As in vLLM: every listing is built (a class listed
twice runs twice), installed plugins come first (entry-point groups
``vllm.logits_processors`` and ``raysample.logits_processors``), a module that
cannot be imported is a ``RuntimeError``, a missing attribute an
``AttributeError``, and a name without ``:`` or a non-processor a ``ValueError``
(every one of them is also a ``LogitsProcessorLoadError``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import pkgutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Union

import torch

from processors.builtins.vllm_builtins import BUILTIN_LOGITS_PROCESSORS
from processors.interface import LogitsProcessor
from processors.sampling_params import SamplingParams
from processors.state import LogitsProcessors

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "raysample.logits_processors"
LOGITSPROCS_GROUP = "vllm.logits_processors"  # where vLLM plugin packages register
ENTRY_POINT_GROUPS = (LOGITSPROCS_GROUP, ENTRY_POINT_GROUP)
STR_POOLING_REJECTS_LOGITSPROCS = "Pooling models do not support custom logits processors."


class LogitsProcessorLoadError(ValueError):
    """A custom processor item could not be turned into a ``LogitsProcessor`` class."""


class LogitsProcessorImportError(RuntimeError, LogitsProcessorLoadError):
    """A processor's module or plugin could not be imported (vLLM raises ``RuntimeError``)."""


class LogitsProcessorAttributeError(AttributeError, LogitsProcessorLoadError):
    """The module has no such attribute (vLLM's ``getattr`` raises ``AttributeError``)."""


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
    from processors.mrv2 import LogitsProcessor as SlotLogitsProcessor

    if not isinstance(obj, type):
        raise LogitsProcessorLoadError(
            f"Loaded logit processor must be a type: {describe(item)} is not a class (it is a "
            f"{type(obj).__name__})."
        )
    if not issubclass(obj, (LogitsProcessor, SlotLogitsProcessor)):
        raise LogitsProcessorLoadError(
            f"Logits processor {describe(item)} is not a subclass of processors.LogitsProcessor."
        )
    return obj


def resolve_fqcn(name: str) -> type[LogitsProcessor]:
    """Import ``"pkg.module:Qualified.Name"`` and check it is a processor class."""
    if not isinstance(name, str) or not name.strip():
        raise LogitsProcessorLoadError(f"Logits processor name must be a non-empty string, got {name!r}.")
    parts = name.split(":")
    if len(parts) != 2 or not all(part.strip() for part in parts):  # vLLM's rule, and its words
        raise LogitsProcessorLoadError(f"Invalid logits processor FQCN {name!r}. Expected format: '<module>:<type>'")
    module_path, qualname = parts
    try:
        obj: Any = pkgutil.resolve_name(name)
    except AttributeError as exc:
        if module_path not in sys.modules:  # raised while importing the module itself
            raise LogitsProcessorImportError(
                f"Logits processor {name!r}: module {module_path!r} could not be imported ({type(exc).__name__}: {exc})."
            ) from exc
        raise LogitsProcessorAttributeError(f"Logits processor {name!r}: {exc}.") from exc
    except Exception as exc:
        raise LogitsProcessorImportError(
            f"Logits processor {name!r}: module {module_path!r} could not be imported ({type(exc).__name__}: {exc})."
        ) from exc
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


def load_entry_point_processors(groups: Sequence[str] = ENTRY_POINT_GROUPS) -> list[type[LogitsProcessor]]:
    """Every class installed under the entry-point groups (all of them, as vLLM)."""
    classes = []
    for group in groups:
        classes.extend(_load_group(group))
    return classes


def _load_group(group: str) -> list[type[LogitsProcessor]]:
    classes = []
    for entry_point in importlib.metadata.entry_points(group=group):
        try:
            obj = entry_point.load()
        except Exception as exc:
            raise LogitsProcessorImportError(
                f"Logits processor entry point {entry_point.name!r} = {entry_point.value!r} (group {group!r}) "
                f"could not be loaded ({type(exc).__name__}: {exc})."
            ) from exc
        classes.append(_check_class(obj, f"entry point {entry_point.name!r} = {entry_point.value!r}"))
    return classes


def split_by_interface(
    loaded: list[tuple[type, dict[str, Any]]],
) -> tuple[list[tuple[type, dict[str, Any]]], list[tuple[type, dict[str, Any]]]]:
    """(batch-level processors, slot-keyed Model Runner V2 processors), order kept."""
    batch_level = [(cls, kw) for cls, kw in loaded if issubclass(cls, LogitsProcessor)]
    return batch_level, [(cls, kw) for cls, kw in loaded if not issubclass(cls, LogitsProcessor)]


def load_custom_processors(
    custom: Iterable[CustomProcessor] = (), entry_points: bool = True
) -> list[tuple[type[LogitsProcessor], dict[str, Any]]]:
    """Entry-point classes (unless turned off), then the given items; every listing counts."""
    plugins = [(cls, {}) for cls in load_entry_point_processors()] if entry_points else []
    return plugins + [resolve(item) for item in custom]


def build_logitsprocs(
    vllm_config: Any,
    device: torch.device | str,
    is_pin_memory: bool,
    is_pooling_model: bool | Sequence[CustomProcessor] = False,
    custom_logitsprocs: Sequence[CustomProcessor] = (),
    *,
    custom: Sequence[CustomProcessor] | None = None,
    entry_points: bool = True,
) -> LogitsProcessors:
    """Instantiate builtins, entry-point processors and custom items, in that order.

    vLLM's signature, by position or keyword; raysample's older form (custom items as the
    fourth argument, or ``custom=``) works too.
    """
    if not isinstance(is_pooling_model, bool):  # build_logitsprocs(config, device, pin, [items])
        custom_logitsprocs, is_pooling_model = is_pooling_model, False
    items = list(custom_logitsprocs) + list(custom or ())
    if is_pooling_model:
        if items:
            raise ValueError(STR_POOLING_REJECTS_LOGITSPROCS)
        return LogitsProcessors()
    device = torch.device(device)
    procs: list[LogitsProcessor] = [cls(vllm_config, device, is_pin_memory) for cls in BUILTIN_LOGITS_PROCESSORS]
    for cls, kwargs in load_custom_processors(items, entry_points):
        if not issubclass(cls, LogitsProcessor):
            raise LogitsProcessorLoadError(
                f"Logits processor {describe(cls)} uses the slot-keyed (Model Runner V2) interface; "
                "the engine's Sampler runs it, build_logitsprocs builds batch-level processors only."
            )
        try:
            procs.append(cls(vllm_config, device, is_pin_memory, **kwargs))
        except Exception as exc:
            raise LogitsProcessorLoadError(
                f"Logits processor {describe(cls)} failed in its constructor ({type(exc).__name__}: {exc})."
            ) from exc
    return LogitsProcessors(procs)


@lru_cache(maxsize=64)
def _cached_custom_classes(custom: tuple[CustomProcessor, ...], entry_points: bool) -> tuple[type[LogitsProcessor], ...]:
    return tuple(dict.fromkeys(cls for cls, _ in load_custom_processors(custom, entry_points)))


def validate_logits_processors_parameters(
    custom: Sequence[CustomProcessor] | None, sampling_params: SamplingParams, entry_points: bool = True
) -> None:
    """Run every custom processor class's ``validate_params`` on one request's params."""
    for cls in _cached_custom_classes(tuple(custom or ()), entry_points):
        cls.validate_params(sampling_params)

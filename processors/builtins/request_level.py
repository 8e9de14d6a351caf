"""Request-level processors written for vLLM's old interface, named by class in a config.

Libraries such as ``logits-processor-zoo`` ship callables constructed with a
tokenizer and settings, then called per request as
``(prompt_ids, past_ids, scores_row)``. ``RequestLevelAdapter`` runs them in
the batch model through ``AdapterLogitsProcessor``: a request turns one on
with ``extra_args[enable_with]``, either ``true`` or a mapping of extra
constructor arguments; the engine-wide ``kwargs`` come from the config. The
model's tokenizer is passed as ``tokenizer``.
"""

from __future__ import annotations

import inspect
import pkgutil
from functools import cache
from typing import Any

import torch

from processors.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from processors.sampling_params import SamplingParams


@cache
def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def import_target(target: str) -> Any:
    """``"pkg.module:Qualified.name"`` or ``"pkg.module.name"`` -> the object."""
    return pkgutil.resolve_name(target)


def check_request_setting(spec_kwargs: dict[str, Any], params: SamplingParams) -> None:
    """At admission: the request's ``extra_args[enable_with]`` is true or an object whose keys, with the
    engine's kwargs and the tokenizer, are arguments the callable accepts (so bad kwargs fail the request
    before it runs, not inside a step)."""
    enable_with = spec_kwargs.get("enable_with")
    setting = (params.extra_args or {}).get(enable_with) if enable_with else None
    if setting is None or setting is False or setting is True:
        return
    target = spec_kwargs.get("target")
    if not isinstance(setting, dict):
        raise ValueError(f"extra_args[{enable_with!r}] must be true or an object of arguments for {target}, "
                         f"got {type(setting).__name__}")
    factory = import_target(target) if isinstance(target, str) else target
    kwargs = {**(spec_kwargs.get("kwargs") or {}), **setting}
    tokenizer_arg = spec_kwargs.get("tokenizer_arg", "tokenizer")
    if tokenizer_arg:
        kwargs.setdefault(tokenizer_arg, None)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"extra_args[{enable_with!r}] does not fit {target}: {exc}") from None
    except ValueError:
        return  # no introspectable signature (a builtin): checked when it is built


class RequestLevelAdapter(AdapterLogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool, *, target: Any,
                 enable_with: str, kwargs: dict[str, Any] | None = None, argmax_invariant: bool = False,
                 tokenizer_arg: str = "tokenizer") -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        try:
            self.factory = import_target(target) if isinstance(target, str) else target
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"request-level processor {target!r} could not be imported: {exc}") from exc
        if not callable(self.factory):
            raise ValueError(f"request-level processor {target!r} is not callable")
        self.target = target
        self.enable_with = enable_with
        self.kwargs = dict(kwargs or {})
        self.argmax_invariant = argmax_invariant
        self.tokenizer_arg = tokenizer_arg
        model_config = getattr(vllm_config, "model_config", None)
        self.tokenizer_path = getattr(model_config, "tokenizer", None)

    def is_argmax_invariant(self) -> bool:
        return self.argmax_invariant

    def spec_shared_objects(self) -> tuple[Any, ...]:
        """Shared by every request's callable: never copied with the processor's state."""
        return (_load_tokenizer(self.tokenizer_path),) if self.tokenizer_arg and self.tokenizer_path else ()

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        setting = (params.extra_args or {}).get(self.enable_with)
        if setting is None or setting is False:
            return None
        per_request = setting if isinstance(setting, dict) else {}
        kwargs = {**self.kwargs, **per_request}
        if self.tokenizer_arg and self.tokenizer_path:
            kwargs.setdefault(self.tokenizer_arg, _load_tokenizer(self.tokenizer_path))
        return self.factory(**kwargs)

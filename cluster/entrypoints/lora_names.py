"""The LoRA adapter a job line or a dataset row names by its ``model``: vLLM's ``--lora-modules name=path``.

A name is the served model (the base), one of ``lora.modules``, or, with ``lora.dynamic_lora_loading_path``
set, a directory of that name there (Ray Data LLM's on-demand adapters). Each name gets one
``lora_int_id`` for the run, so its requests share the adapter's weights and its cached prefixes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from processors import LoRARequest


class UnknownModel(LookupError):
    """A line's model is neither the served model nor an adapter: vLLM's 404 words."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")


class LoraNames:
    """Model name -> the ``LoRARequest`` a request runs with (None: the base model)."""

    @classmethod
    def of(cls, config: Any) -> LoraNames:
        """From a run's config: its ``lora`` section and the served model names."""
        return cls(config.lora.modules, config.model.served_names(), config.lora.dynamic_lora_loading_path)

    def __init__(self, modules: dict[str, str], served: list[str], dynamic_path: str | None = None) -> None:
        self.modules = dict(modules)
        self.served = set(served)
        self.dynamic_path = None if dynamic_path is None else Path(dynamic_path).expanduser()
        self._ids: dict[str, LoRARequest] = {}

    def request(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        if not isinstance(name, str) or not name:
            raise ValueError(f"'model' must be a model or LoRA adapter name, got {json.dumps(name)}")
        if name in self.served and name not in self.modules:
            return None
        known = self._ids.get(name)
        if known is not None:
            return known
        path = self.modules.get(name)
        if path is None and self.dynamic_path is not None and "/" not in name and name not in (".", ".."):
            candidate = self.dynamic_path / name
            path = str(candidate) if candidate.is_dir() else None
        if path is None:
            raise UnknownModel(name)
        self._ids[name] = LoRARequest(name, len(self._ids) + 1, str(path))
        return self._ids[name]


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """vLLM's ``--lora-modules`` values: ``name=path``, or ``{"name": ..., "path": ...}`` as JSON."""
    modules: dict[str, str] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                name, path = item["name"], item["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: a JSON module needs \"name\" and \"path\"") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: give name=path")
        if name in modules and modules[name] != path:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules

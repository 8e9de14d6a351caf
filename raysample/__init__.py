"""raysample: the names a user writes against, in one import.

    import raysample
    llm = raysample.LLM("configs/default.yaml")
    llm.generate(["Hello"], raysample.SamplingParams(max_tokens=16))

The logits-processor programming model (``LogitsProcessor``, ``BatchUpdate``, ``SamplingParams``, ...)
is ``processors``'s, unchanged; the engine handles (``LLM``, ``AsyncLLM``, ``Engine``), the config
loader and Ray Data's ``build_processor`` are ``cluster``'s, imported on first use (they bring Ray).
The packages themselves stay importable as before.
"""

from __future__ import annotations

from typing import Any

from processors import (
    AdapterLogitsProcessor,
    BatchUpdate,
    BatchUpdateBuilder,
    EngineConfig,
    LogitsProcessor,
    LoRARequest,
    MoveDirectionality,
    RequestLogitsProcessor,
    SamplingParams,
    StructuredOutputsParams,
    VllmConfig,
    build_logitsprocs,
    process_dict_updates,
)

_FROM_CLUSTER = {"LLM": "cluster.entrypoints.llm", "AsyncLLM": "cluster.entrypoints.llm", "Engine": "cluster.entrypoints.client",
                 "EngineError": "cluster.entrypoints.client", "load_config": "cluster.config", "build_processor": "cluster.entrypoints.data"}

__all__ = [
    "AdapterLogitsProcessor", "AsyncLLM", "BatchUpdate", "BatchUpdateBuilder", "Engine", "EngineConfig", "EngineError",
    "LLM", "LoRARequest", "LogitsProcessor", "MoveDirectionality", "RequestLogitsProcessor", "SamplingParams",
    "StructuredOutputsParams", "VllmConfig", "build_logitsprocs", "build_processor", "load_config",
    "process_dict_updates",
]


def __getattr__(name: str) -> Any:
    if name in _FROM_CLUSTER:
        import importlib

        return getattr(importlib.import_module(_FROM_CLUSTER[name]), name)
    raise AttributeError(f"module 'raysample' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

"""Configuration, Ray start-up and placement, the client handle, the job entrypoint.

``from cluster import LLM`` is vLLM's offline handle (``AsyncLLM`` its streaming one);
``Engine`` is the Ray client handle under them; ``LocalEngine`` runs the same
step loop in one process.
"""

from typing import Any

__all__ = ["LLM", "AsyncLLM", "Engine", "EngineError", "LocalEngine", "load_config"]


def __getattr__(name: str) -> Any:  # import Ray only when the handle is used
    if name in ("Engine", "EngineError"):
        from cluster import client

        return getattr(client, name)
    if name in ("LLM", "AsyncLLM"):
        from cluster import llm

        return getattr(llm, name)
    if name == "LocalEngine":
        from cluster.local_engine import LocalEngine

        return LocalEngine
    if name == "load_config":
        from cluster.config import load_config

        return load_config
    raise AttributeError(name)

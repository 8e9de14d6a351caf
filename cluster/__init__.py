"""The engines and what users call: ``engine/`` (the step loop, no Ray), ``ray/`` (actors, handles,
placement), ``entrypoints/`` (the job CLI, run-batch, ``LLM``, Ray Data), with the configuration
(``config``, resolved once per run) and its checks (``preflight``, ``memory``) beside them.

The public handles: ``LLM`` (vLLM's offline one) and ``AsyncLLM`` (its streaming one),
and ``Engine``, the Ray handle under them (``Engine.from_config``, ``Engine.connect``).
Everything else is internal; ``cluster.entrypoints.engine_factory.build_engine`` builds any engine.
"""

from typing import Any

__all__ = ["LLM", "AsyncLLM", "Engine", "EngineError", "load_config"]


def __getattr__(name: str) -> Any:  # import Ray only when the handle is used
    if name in ("Engine", "EngineError"):
        from cluster.entrypoints import client

        return getattr(client, name)
    if name in ("LLM", "AsyncLLM"):
        from cluster.entrypoints import llm

        return getattr(llm, name)
    if name == "load_config":
        from cluster.config import load_config

        return load_config
    raise AttributeError(name)

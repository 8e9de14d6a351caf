"""The one place an engine is built from a config: in this process, or on Ray (one engine,
or ``cluster.num_engines`` of them behind one handle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.config import RaysampleConfig
from cluster.engine.engine_api import RequestAPI


def build_engine(config: RaysampleConfig | dict[str, Any] | str | Path, local: bool = False) -> RequestAPI:
    """``local``: coordinator and workers in this process (``LocalEngine``), stepped by its
    callers; else an ``Engine`` on Ray (started, or joined per ``cluster.address``)."""
    from cluster.preflight import prepare_run

    config = prepare_run(config, local)  # a no-op for the entry points, which prepared it already
    if local:
        from cluster.engine.local_engine import LocalEngine

        return LocalEngine(config)
    from cluster.entrypoints.client import Engine

    return Engine.from_config(config)

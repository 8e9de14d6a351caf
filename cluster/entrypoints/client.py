"""``Engine``: the Ray handle. Start one from a config, or attach to a running one by name.

With ``cluster.num_engines`` above 1, ``Engine.from_config`` returns k whole engines
behind one handle with the same calls (``cluster.ray.engine_group``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.config import RaysampleConfig
from cluster.preflight import prepare_run
from cluster.ray.engine_handle import EngineError, EngineGone, EngineHandle, with_engine_name
from cluster.ray.ray_cluster import check_cluster_resources, ensure_ray

if TYPE_CHECKING:
    from cluster.ray.engine_group import EngineGroup

__all__ = ["Engine", "EngineError", "EngineGone"]


class Engine(EngineHandle):
    """Handle on a running raysample engine; any number of callers (``Engine.connect`` attaches)."""

    @classmethod
    def from_config(cls, source: RaysampleConfig | dict[str, Any] | str | Path) -> Engine | EngineGroup:
        """Start Ray (or join it, per ``cluster.address``), the workers and the named coordinator.

        With ``cluster.num_engines`` above 1: that many such engines behind one ``EngineGroup``.
        """
        from cluster.ray.memory_on_ray import plan_on_ray

        config = with_engine_name(prepare_run(source, local=False))
        ensure_ray(config)
        config, kv_note = plan_on_ray(config)
        check_cluster_resources(config)
        if config.cluster.num_engines > 1:
            from cluster.ray.engine_group import EngineGroup

            return EngineGroup.from_config(config, kv_note)
        return cls.start(config, kv_note)

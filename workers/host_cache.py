"""Where raysample keeps what it builds once per host: converted models, probe verdicts, kernel builds."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``RAYSAMPLE_CACHE_DIR`` (``RAYSAMPLE_CACHE``, its older name), else ``~/.cache/raysample``."""
    for name in ("RAYSAMPLE_CACHE_DIR", "RAYSAMPLE_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name])
    return Path.home() / ".cache" / "raysample"

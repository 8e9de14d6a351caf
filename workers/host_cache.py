"""Where raysample keeps what it builds once per host: converted models, probe verdicts, kernel builds."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """``RAYSAMPLE_CACHE_DIR`` (``RAYSAMPLE_CACHE``, its older name), else ``~/.cache/raysample``."""
    for name in ("RAYSAMPLE_CACHE_DIR", "RAYSAMPLE_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name])
    return Path.home() / ".cache" / "raysample"


@contextmanager
def one_maker(entry: Path) -> Iterator[None]:
    """Held while one process makes ``entry``: the workers of an engine start together, and each would
    otherwise make the same entry on the same cores at once. A process that waited finds it made."""
    try:
        import fcntl
    except ImportError:  # no advisory locks here: entries are still published whole, only made twice
        yield
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(entry.with_suffix(".lock"), "w")
    except OSError:  # an unwritable cache: the caller makes the entry unshared, as it would anyway
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

"""Where raysample keeps what it builds once per host (converted models, tiny models, probe verdicts,
kernel builds), and how it checks them before use.

Nothing in the cache is trusted because it exists: a directory carries a manifest of every file's
size and SHA-256, written when it was built, and a kernel build a record of its own; a reader
checks them and rebuilds what does not match (docs/reliability.md, "What is verified at load").
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MANIFEST = ".complete"  # a built directory's manifest: its presence says the directory is whole
LOCK_TIMEOUT_S = 900.0  # cache.lock_timeout_s: how long to wait for another process's build
_verified: dict[str, tuple] = {}  # this process's checks: path -> the stat it had when it verified


def cache_root() -> Path:
    """``RAYSAMPLE_CACHE_DIR`` (``RAYSAMPLE_CACHE``, its older name), else ``~/.cache/raysample``."""
    for name in ("RAYSAMPLE_CACHE_DIR", "RAYSAMPLE_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name])
    return Path.home() / ".cache" / "raysample"


class CacheLockTimeout(RuntimeError):
    """Another live process held a cache entry's lock past ``cache.lock_timeout_s``."""


def set_lock_timeout(seconds: float) -> None:
    """``cache.lock_timeout_s`` of the run, for every lock this process takes from now on."""
    global LOCK_TIMEOUT_S
    LOCK_TIMEOUT_S = float(seconds)


@contextmanager
def one_maker(entry: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Held while one process makes ``entry``: the workers of an engine start together, and each would
    otherwise make the same entry on the same cores at once. A process that waited finds it made.

    A lock another live process holds is waited on with one line saying who holds it, for at most
    ``timeout_s`` (``cache.lock_timeout_s``), then ``CacheLockTimeout``. A lock dies with its holder."""
    try:
        import fcntl
    except ImportError:  # no advisory locks here: entries are still published whole, only made twice
        yield
        return
    path = entry.with_suffix(".lock")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a+")
    except OSError:  # an unwritable cache: the caller makes the entry unshared, as it would anyway
        yield
        return
    limit = LOCK_TIMEOUT_S if timeout_s is None else timeout_s
    with lock:
        started, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(path)
                waited = time.monotonic() - started
                if waited >= limit:
                    raise CacheLockTimeout(
                        f"{path} is still held by {holder} after {waited:.0f} s (cache.lock_timeout_s={limit:g}); "
                        f"if that process is stuck, end it, or raise cache.lock_timeout_s") from None
                if not told and waited >= 1.0:
                    print(f"raysample: waiting for {holder}, which holds {path} while it builds {entry.name} "
                          f"(at most cache.lock_timeout_s={limit:g} s)", file=sys.stderr, flush=True)
                    told = True
                time.sleep(0.2)
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(f"{os.getpid()}\n")
            lock.flush()
        except OSError:
            pass
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _holder(lock_path: Path) -> str:
    try:
        pid = lock_path.read_text().strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


# ----- what a built entry holds, and whether it still does -----


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _stat_key(path: Path) -> tuple:
    """What changes whenever a file's bytes are written through the filesystem (its change time
    cannot be set back by a user, as its modification time can)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def write_manifest(folder: Path, note: str = "") -> None:
    """Record every file of ``folder`` (not hidden ones) with its size and SHA-256: call it last, when
    the folder is whole (still under its temporary name, before it is renamed into place)."""
    files = {item.name: {"size": item.stat().st_size, "sha256": file_digest(item)}
             for item in sorted(folder.iterdir()) if item.is_file() and not item.name.startswith(".")}
    (folder / MANIFEST).write_text(json.dumps({"note": note, "files": files}, indent=1) + "\n")


def manifest_problem(folder: Path) -> str | None:
    """None when ``folder`` holds exactly what its manifest lists, byte for byte; else one line naming
    the first file that differs. A file is hashed again whenever its size or change time differs from
    when this host last verified it (kept in ``.verified`` beside the manifest, and per process)."""
    manifest = folder / MANIFEST
    try:
        listed = json.loads(manifest.read_text())["files"]
        if not isinstance(listed, dict) or not listed:
            raise ValueError("no files listed")
    except FileNotFoundError:
        return f"{folder} has no manifest ({MANIFEST}): it was not finished, or was made by an older raysample"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest} cannot be read ({type(exc).__name__}: {exc})"
    present = {item.name for item in folder.iterdir() if item.is_file() and not item.name.startswith(".")}
    for extra in sorted(present - set(listed)):
        return f"{folder / extra} is not in the manifest"
    stamps_path = folder / ".verified"
    try:
        stamps = json.loads(stamps_path.read_text())
        if not isinstance(stamps, dict):
            stamps = {}
    except (OSError, ValueError):
        stamps = {}
    fresh = {}
    for name, entry in listed.items():
        path = folder / name
        try:
            size, digest = int(entry["size"]), str(entry["sha256"])
            key = _stat_key(path)
        except FileNotFoundError:
            return f"{path} is missing"
        except (OSError, KeyError, TypeError, ValueError) as exc:
            return f"{path} cannot be checked ({type(exc).__name__}: {exc})"
        if key[2] != size:
            return f"{path} has {key[2]} bytes where {size} were written"
        remembered = _verified.get(str(path))
        if remembered == key or stamps.get(name) == list(key):
            fresh[name] = list(key)
            continue
        if file_digest(path) != digest:
            return f"{path} does not match the SHA-256 recorded when it was written (damaged or edited)"
        fresh[name] = list(key)
        _verified[str(path)] = key
    if fresh != stamps:
        try:
            staging = stamps_path.with_name(f".verified.{os.getpid()}.tmp")
            staging.write_text(json.dumps(fresh))
            staging.replace(stamps_path)
        except OSError:
            pass  # a read-only cache: verified again next time
    return None


def set_aside(folder: Path) -> None:
    """Take a damaged entry out of the way (renamed, then removed), so it is built again. A process
    still reading it keeps its open files; one that arrives later finds it gone."""
    import shutil

    aside = folder.with_name(f".damaged-{folder.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        folder.rename(aside)
    except OSError:
        return  # set aside (or rebuilt) by another process meanwhile
    shutil.rmtree(aside, ignore_errors=True)

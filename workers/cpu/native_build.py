"""Building the C++ CPU kernels (``workers/cpu/native/*.cpp``) with the system compiler, for ctypes.

Each is a plain shared library (no torch headers) that takes some seconds to compile: ``make setup``
builds them, and a worker that finds one missing builds it on first use. Builds live in the host's
cache (``~/.cache/raysample/kernels``), not beside the source: a job's copy of the code (``ray job
submit``'s working directory, a second clone) finds the build the last one made instead of compiling
again. The file name carries a hash of the source, the flags and this CPU's features, so a stale or
foreign build is never loaded, and a lock makes the workers that start together compile it once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from workers.host_cache import cache_root, file_digest, one_maker

STALE_AFTER_S = 30 * 24 * 3600  # another source's build unused this long is removed when one is built


class NativeKernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here (no compiler, or the build failed)."""


def loads(load: Callable[[], object], fallback: str) -> bool:
    """Whether ``load`` builds and loads a kernel here; if not, logs why and what runs instead."""
    try:
        load()
        return True
    except NativeKernelUnavailable as exc:
        logging.getLogger(load.__module__).warning("%s: %s", fallback, exc)
        return False


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def target_flags(flags: list[str]) -> list[str]:
    """``flags`` with ``-march=native`` replaced by ``RAYSAMPLE_KERNEL_MARCH`` where it is set (for
    instance ``x86-64-v3``: AVX2 without AVX-512), so a CPU that has AVX-512 can build and test the
    kernels another CPU would run (docs/reliability.md)."""
    march = os.environ.get("RAYSAMPLE_KERNEL_MARCH")
    return [f"-march={march}" if march and flag == "-march=native" else flag for flag in flags]


def library_path(source: Path, flags: list[str]) -> Path:
    """Where the build of this source (with the headers beside it), these flags and this CPU lives:
    ``RAYSAMPLE_KERNEL_DIR``, else the host's cache (``RAYSAMPLE_CACHE_DIR``, else ``~/.cache/raysample``)."""
    flags = target_flags(flags)
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    for part in (source.read_bytes(), *headers, " ".join(flags).encode(), platform.machine().encode(),
                 _cpu_signature().encode()):
        digest.update(part)
    folder = Path(os.environ.get("RAYSAMPLE_KERNEL_DIR") or cache_root() / "kernels")
    return folder / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def build_record(library: Path) -> Path:
    """Beside each build: its size and SHA-256, written when it was compiled."""
    return library.with_suffix(".sha256")


def build_problem(library: Path) -> str | None:
    """None when ``library`` is the file that was compiled (size and SHA-256 as recorded); else why not.
    A library is never loaded unchecked: a truncated one crashed the process in ``dlopen`` (SIGBUS), a
    zeroed one computed NaN."""
    if not library.exists():
        return "not built"
    try:
        recorded = json.loads(build_record(library).read_text())
        size, digest = int(recorded["size"]), str(recorded["sha256"])
    except FileNotFoundError:
        return f"{library} has no record of its build ({build_record(library).name})"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{build_record(library)} cannot be read ({type(exc).__name__})"
    try:
        actual = library.stat().st_size
        if actual != size:
            return f"{library} has {actual} bytes where {size} were built"
        if file_digest(library) != digest:
            return f"{library} does not match the SHA-256 recorded at its build (damaged or replaced)"
    except OSError as exc:
        return f"{library} cannot be read ({exc.strerror or exc})"
    return None


def build(source: Path, flags: list[str]) -> Path:
    """Compile ``source`` unless this exact build exists and verifies; atomic, so concurrent workers may
    race. A build that does not verify is compiled again."""
    target = library_path(source, flags)
    if build_problem(target) is None:
        return target
    wanted = os.environ.get("CXX")
    compiler = shutil.which(wanted) if wanted else shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise NativeKernelUnavailable(f"no C++ compiler: CXX={wanted!r} not found" if wanted
                                      else "no C++ compiler (g++, c++ or clang++) on PATH")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeKernelUnavailable(f"cannot create {target.parent} for the build ({exc.strerror}); "
                                      "set RAYSAMPLE_KERNEL_DIR to a writable directory") from None
    with one_maker(target):
        problem = build_problem(target)
        if problem is None:  # built by the process that held the lock before this one
            return target
        if problem != "not built":
            logging.getLogger(__name__).warning("%s; compiling it again", problem)
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            command = [compiler, *target_flags(flags), "-o", str(partial), str(source)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeKernelUnavailable(f"{compiler} failed to build {source.name}:\n{result.stderr[-2000:]}")
            record = {"size": partial.stat().st_size, "sha256": file_digest(partial)}
            staging = build_record(target).with_name(f"{partial.name}.sha256")
            staging.write_text(json.dumps(record) + "\n")
            os.replace(partial, target)  # the library first: a record never vouches for a file not yet in place
            os.replace(staging, build_record(target))
        finally:
            partial.unlink(missing_ok=True)
            build_record(target).with_name(f"{partial.name}.sha256").unlink(missing_ok=True)
    _remove_stale(source, target)
    return target


def _remove_stale(source: Path, target: Path) -> None:
    """Builds of this kernel from older sources, once unused for a month. Not sooner: the cache is
    shared by every checkout on the host and by the builds for other targets (``RAYSAMPLE_KERNEL_MARCH``),
    and a loaded library stays mapped anyway."""
    now = time.time()
    for stale in target.parent.glob(f"{source.stem}-*.so"):
        try:
            if stale != target and now - stale.stat().st_atime > STALE_AFTER_S:
                stale.unlink()
                stale.with_suffix(".lock").unlink(missing_ok=True)
                build_record(stale).unlink(missing_ok=True)
        except OSError:
            pass  # removed by another process meanwhile

"""Building the C++ CPU kernels (``workers/cpu/native/*.cpp``) with the system compiler, for ctypes.

Each is a plain shared library (no torch headers), so it compiles in about a second: ``make
setup`` builds them, and a worker that finds one missing builds it on first use. The file name
carries a hash of the source, the flags and this CPU's features, so a stale or foreign build is
never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


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
    """Where the build of this source (with the headers beside it), these flags and this CPU lives.

    ``RAYSAMPLE_KERNEL_DIR``, else ``build/`` beside the source, else (an installed, read-only
    package) the user's cache.
    """
    flags = target_flags(flags)
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    for part in (source.read_bytes(), *headers, " ".join(flags).encode(), platform.machine().encode(),
                 _cpu_signature().encode()):
        digest.update(part)
    folder = Path(os.environ.get("RAYSAMPLE_KERNEL_DIR") or source.parent / "build")
    if "RAYSAMPLE_KERNEL_DIR" not in os.environ and not os.access(source.parent, os.W_OK):
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raysample" / "kernels"
    return folder / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def build(source: Path, flags: list[str]) -> Path:
    """Compile ``source`` unless this exact build exists; atomic, so concurrent workers may race."""
    target = library_path(source, flags)
    if target.exists():
        return target
    wanted = os.environ.get("CXX")
    compiler = shutil.which(wanted) if wanted else shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise NativeKernelUnavailable(f"no C++ compiler: CXX={wanted!r} not found" if wanted
                                      else "no C++ compiler (g++, c++ or clang++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        command = [compiler, *target_flags(flags), "-o", str(partial), str(source)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeKernelUnavailable(f"{compiler} failed to build {source.name}:\n{result.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    for stale in target.parent.glob(f"{source.stem}-*.so"):  # builds of older sources (a loaded one stays mapped)
        if stale != target:
            stale.unlink(missing_ok=True)
    return target

"""CPU each CPython 3.11 on this machine spends importing what every process of a run imports first.

A test run or a job starts many processes (Ray actors, job drivers, grammar compilers), and each imports
torch, transformers' modeling code and Ray before its first useful line: most of a process's start-up
CPU. The Makefile makes the venv from the distribution's CPython 3.11 where there is one; this measures
that choice against every other CPython 3.11 found, alternating runs, in CPU seconds (user + system) of
each whole child process, the venv's packages on its path. The ratio is against the first interpreter.

    python bench/interpreter.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig

CHILD = """
import site, sys
site.addsitedir(sys.argv[1])
import torch, transformers.modeling_utils, ray
"""


def interpreters() -> list[str]:
    """Distinct CPython 3.11 binaries: this venv's own first, then the distribution's and PATH's."""
    found: list[str] = []
    names = [getattr(sys, "_base_executable", sys.executable), "/usr/bin/python3.11", shutil.which("python3.11"),
             shutil.which("python3")]
    for name in filter(None, names):
        try:  # a pyenv shim is a script: ask the interpreter behind it where it lives
            done = subprocess.run([name, "-c", "import sys; print(sys.version_info[:2] == (3, 11), sys.executable)"],
                                  capture_output=True, text=True, timeout=60)
        except OSError:
            continue
        ok, _, path = done.stdout.strip().partition(" ")
        if done.returncode == 0 and ok == "True":
            real = os.path.realpath(path)
            if real not in found:
                found.append(real)
    return found


def import_cpu_s(python: str, site_packages: str) -> float:
    """CPU seconds of one child process that imports torch, transformers' modeling code and Ray."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-c", CHILD, site_packages], check=True, capture_output=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def describe(python: str) -> str:
    linked = subprocess.run(["ldd", python], capture_output=True, text=True).stdout if shutil.which("ldd") else ""
    return "libpython shared" if "libpython" in linked else "libpython static"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    site_packages = sysconfig.get_paths()["purelib"]
    pythons = interpreters()
    for python in pythons:  # warm: the bytecode caches written, the files in the page cache
        import_cpu_s(python, site_packages)
    times: dict[str, list[float]] = {python: [] for python in pythons}
    for _ in range(args.repeats):
        for python in pythons:
            times[python].append(import_cpu_s(python, site_packages))
    reference = statistics.median(times[pythons[0]])
    print(f"import torch, transformers.modeling_utils, ray: CPU seconds of the whole process, {args.repeats} runs each")
    for python in pythons:
        median = statistics.median(times[python])
        print(f"{python:45s} {describe(python):17s} median {median:.2f} s (min {min(times[python]):.2f}) "
              f"= {median / reference:.2f}x the first")


if __name__ == "__main__":
    main()

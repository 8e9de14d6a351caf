"""Intra-op threads for CPU compute: one per core a process may use, never more.

Several workers on a host each running torch's default thread count oversubscribe its
cores; a worker takes the CPU share Ray gave it (``cpus_per_worker``), the in-process
engine the cores this process may run on.
"""

from __future__ import annotations

import math
import os

import torch

from workers.step.compute_thread import set_compute_threads


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_for_share(share: float | None = None) -> int:
    """Intra-op threads for a CPU share: ``floor(share)`` (at least 1), or the usable cores; never more."""
    threads = max(1, math.floor(share)) if share is not None else usable_cores()
    return min(threads, usable_cores())


def set_cpu_threads(share: float | None = None) -> int:
    """Set torch's intra-op threads from ``threads_for_share`` (here and on the compute thread); return them."""
    threads = threads_for_share(share)
    torch.set_num_threads(threads)  # this thread's OpenMP team, and threads started from now on
    set_compute_threads(threads)  # the compute thread, which may have started before
    return threads

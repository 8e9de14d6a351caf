"""Host memory for CPU forwards: freed step tensors stay in the heap, KV pools are mapped lazily.

Why: glibc serves an allocation above its mmap threshold from a fresh mapping, unmaps it on free,
and hands a thread arena's free top back to the kernel; the next step's tensor of that size then
faults in every page again. A bfloat16 decode step of SmolLM2 at 64 rows allocates its logits
twice (6.3 MB from the LM head, 12.6 MB as float32), some 4,600 pages. With a fault at about
2.6 us on the machines here, the faults of a 256-request chat run took 0.04 to 1.8 s of its 28 s
from one run to the next, as glibc's own threshold and trimming fell (`perf record -e
page-faults`: two thirds of them in the logits' float32 copy). ``keep_freed_memory`` raises the
thresholds so that such tensors come from the heap and go back to it, as vLLM's CPU backend gets
by preloading tcmalloc; peak memory is what the step needs, as before, only not returned between
steps. The KV pools, which should stay uncommitted until used, are mapped directly
(``lazy_zeros``), so the thresholds do not move them into the heap.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import platform
from functools import lru_cache

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Tell glibc's malloc (this process, once) to serve allocations up to 32 MiB from its heap and
    to keep up to 1 GiB of freed memory there; False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    logger.debug("glibc malloc keeps freed step tensors: %s", done)
    return done


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in its own anonymous mapping: the kernel's zero pages, committed as
    they are first written, so a large budget costs no start-up time and no memory until used,
    whatever malloc's thresholds are (``torch.zeros`` writes it all)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes)  # anonymous and private; the tensor holds it alive
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)

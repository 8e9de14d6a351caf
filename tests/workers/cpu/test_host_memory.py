"""Host memory of CPU forwards (``workers.cpu.host_memory``): step-sized tensors come from malloc's heap
once the runner has set its thresholds, and KV pools are zeros that commit no memory until written.

The malloc checks run in fresh interpreters, whose heap no other test has shaped: glibc's own
threshold moves up after the first large free, so only a first large allocation tells the two apart.
"""

from __future__ import annotations

import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.cpu.host_memory import keep_freed_memory, lazy_zeros

ROOT = Path(__file__).resolve().parents[3]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Bytes malloc holds in mapped chunks before and after a first 16 MiB tensor (mallinfo2's hblkhd).
_PROBE = """
import ctypes, sys
import torch
from workers.cpu.host_memory import keep_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = mallinfo2().hblkhd
tensor = torch.ones(4 << 20)  # 16 MiB of float32: over glibc's initial 128 KiB threshold
print(mallinfo2().hblkhd - before)
"""


def _mapped_bytes_for_first_large_tensor(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="malloc's thresholds are glibc's (mallopt); elsewhere nothing is set")
def test_after_keep_freed_memory_a_step_sized_tensor_comes_from_the_heap():
    assert _mapped_bytes_for_first_large_tensor("default") >= 16 << 20  # glibc's own: a fresh mapping
    assert _mapped_bytes_for_first_large_tensor("keep") == 0


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_keep_freed_memory_is_set_once_and_says_so():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True


def test_lazy_zeros_are_zeros_that_commit_only_what_is_written():
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    pool = lazy_zeros((1024, 3, 16, 64, 32), torch.bfloat16)  # 192 MiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 1000  # 49,152 pages if written
    assert pool.shape == (1024, 3, 16, 64, 32) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    pool[7, 1, 3] = 2.5
    import gc

    gc.collect()  # the mapping lives as long as the tensor, not the function that made it
    assert pool[7, 1, 3].eq(2.5).all() and pool.count_nonzero() == 64 * 32
    assert pool.sum().item() == 2.5 * 64 * 32
    assert lazy_zeros((0, 3), torch.float32).shape == (0, 3)


def test_a_cpu_model_runner_sets_the_thresholds_and_maps_its_pools(monkeypatch):
    from arch_zoo import build_arch_model

    from workers.cpu import host_memory
    from workers.model.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    runner = ModelRunner(build_arch_model("llama"), "cpu", "float32", max_model_len=64, kv_cache_memory=1 << 20,
                         verify=False)
    assert calls == [1]
    pool = runner.cache.keys[0]
    assert not pool.any()
    if Path("/proc/self/maps").exists():  # its own mapping: the data starts where a mapping starts
        starts = {int(line.split("-")[0], 16) for line in Path("/proc/self/maps").read_text().splitlines()}
        assert pool.data_ptr() in starts

"""Deterministic digests of processor state for the cross-replica audit."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def digest_of(*parts: Any) -> bytes:
    """Hash plain data (ints, floats, strings, tuples, lists, numpy arrays) stably.

    ``repr`` of plain Python data is identical across processes and machines;
    arrays contribute their dtype, shape and raw bytes.
    """
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(f"{part.dtype}{part.shape}".encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"\x00")
    return h.digest()


def dict_items_sorted(entries: dict[int, Any]) -> list[tuple[int, Any]]:
    return sorted(entries.items(), key=lambda kv: kv[0])

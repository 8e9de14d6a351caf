"""Prompt-lookup (n-gram) drafting, run on the coordinator so every replica sees the same drafts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramDrafter:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's tail.

    Tries tail lengths from ``max_n`` down to ``min_n``; the first match wins.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens continuing ``tokens`` (may be empty)."""
        k = self.k if limit is None else min(self.k, limit)
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        total = len(seq)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            tail = seq[total - n :]
            # Windows starting at 0..total-n-1 (the tail itself excluded), latest first.
            windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start : start + k].tolist()
        return []

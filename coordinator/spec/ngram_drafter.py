"""Prompt-lookup (n-gram) drafting, run on the coordinator so every replica sees the same drafts."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("q").itemsize  # bytes per token id in the searched buffer


class NgramDrafter:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's tail.

    Tries tail lengths from ``max_n`` down to ``min_n``; the first match wins. The search is a
    byte-level ``rfind`` over the ids packed as int64 (matches off a token boundary are skipped).
    The engine proposes for all rows at once with ``coordinator.spec.ngram_batch``, which must give
    what this search gives (a property test holds it so) and asks it on a hash collision.
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
        total = len(tokens)
        if k <= 0 or total < self.min_n + 1:
            return []
        data = array("q", tokens).tobytes()
        searched = (total - 1) * _WIDTH  # an occurrence must end before the last token
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            tail = data[(total - n) * _WIDTH :]
            pos = data.rfind(tail, 0, searched)
            while pos > 0 and pos % _WIDTH:  # straddles two ids: look further left
                pos = data.rfind(tail, 0, pos + len(tail) - 1)
            if pos >= 0:
                start = pos // _WIDTH + n
                return list(tokens[start : start + k])
        return []

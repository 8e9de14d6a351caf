"""Prompt-lookup (n-gram) drafting, run on the coordinator so every replica sees the same drafts."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("q").itemsize  # bytes per token id in the searched buffer


class NgramDrafter:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's tail.

    Tries tail lengths from ``max_n`` down to ``min_n``; the first match wins. The search is a
    byte-level ``rfind`` over the ids packed as int64 (matches off a token boundary are skipped):
    it runs for every decoding row every step, and at 64 rows a windowed numpy comparison cost
    several milliseconds per step.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose_for(self, index: NgramIndex, output: list[int], limit: int | None = None) -> list[int]:
        """What ``propose(prompt + output, limit)`` returns, from a per-request index that only
        takes in the tokens added since its last call (no search over the whole history).

        Runs for every decoding row every step, so it is written flat: one call per row, and
        an n-gram's key is an int (its ids packed ``KEY_BITS`` apart) in a dict per length."""
        k = self.k if limit is None or limit > self.k else limit
        tokens, latest, min_n = index.tokens, index.latest, self.min_n
        before = len(tokens)
        seen = before - index.prompt_len
        if len(output) > seen:
            tokens.extend(output[seen:])
            index.add_ends(before, len(tokens))
        total = len(tokens)
        if k <= 0 or total < min_n + 1:
            return []
        top = self.max_n if self.max_n < total - 1 else total - 1
        key = 0
        for n in range(1, top + 1):
            key |= tokens[total - n] << (KEY_BITS * (n - 1))
        for n in range(top, min_n - 1, -1):
            end = latest[n].get(key)
            if end is not None:
                return tokens[end : end + k]
            key &= (1 << (KEY_BITS * (n - 1))) - 1  # drop the oldest id
        return []

    def new_index(self, prompt: list[int]) -> NgramIndex:
        return NgramIndex(prompt, self.min_n, self.max_n)

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


KEY_BITS = 24  # n-gram keys pack token ids this far apart: vocabularies up to 2**24 (the coordinator checks)


class NgramIndex:
    """One request's n-grams (``min_n..max_n`` tokens), each mapped to the end of its latest
    occurrence that ends before the last token: the match ``NgramDrafter.propose`` finds by
    searching. ``NgramDrafter.propose_for`` indexes the tokens added since its last call."""

    __slots__ = ("tokens", "latest", "prompt_len", "min_n", "max_n")

    def __init__(self, prompt: list[int], min_n: int, max_n: int) -> None:
        if any(t >> KEY_BITS for t in prompt):
            raise ValueError(f"token ids must be below 2**{KEY_BITS} for n-gram drafting")
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.min_n, self.max_n = min_n, max_n
        self.latest: list[dict[int, int]] = [{} for _ in range(max_n + 1)]  # by n-gram length
        self.add_ends(1, len(prompt))

    def add_ends(self, first_end: int, total: int) -> None:
        """Index the occurrences ending at ``first_end .. total - 1`` (before the last token)."""
        tokens, latest, min_n, max_n = self.tokens, self.latest, self.min_n, self.max_n
        for end in range(first_end if first_end > min_n else min_n, total):
            key = 0
            top = max_n if max_n < end else end
            for n in range(1, top + 1):
                key |= tokens[end - n] << (KEY_BITS * (n - 1))
                if n >= min_n:
                    latest[n][key] = end

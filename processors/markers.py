"""Finding a reasoning marker (``<think>``, ``</think>``) in a row's tokens.

A real tokenizer spells the same text many ways: SmolLM2 writes ``"<think>"``
as ``[44, 17400, 46]`` but ``" <think>"`` as ``[2067, 17400, 46]``, because the
space merges into the first token. Matching one fixed id sequence would miss
the marker whenever text precedes it, so the default ``TextMarker`` matches the
decoded text: an occurrence "ends at" the token in which its last character
appears. ``TokenMarker`` matches an exact id sequence, for models whose marker
is one special token or configs that give the ids.

Both answer the same two questions about ``tokens`` and return end indices
(exclusive): the last occurrence ending in ``(lo, hi]`` and the first ending
after ``lo``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol


class Marker(Protocol):
    def last_end(self, tokens: Sequence[int], lo: int, hi: int) -> int: ...

    def first_end(self, tokens: Sequence[int], lo: int) -> int: ...

    @property
    def span(self) -> int:
        """Tokens an occurrence can cover at most: how far back a rescan must start."""
        ...


class TokenMarker:
    def __init__(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("a reasoning marker must have at least one token")
        self.ids = list(token_ids)

    @property
    def span(self) -> int:
        return len(self.ids)

    def last_end(self, tokens: Sequence[int], lo: int, hi: int) -> int:
        n = len(self.ids)
        for end in range(hi, max(lo, n - 1), -1):
            if list(tokens[end - n : end]) == self.ids:
                return end
        return -1

    def first_end(self, tokens: Sequence[int], lo: int) -> int:
        n = len(self.ids)
        for end in range(max(lo + 1, n), len(tokens) + 1):
            if list(tokens[end - n : end]) == self.ids:
                return end
        return -1


class TextMarker:
    """The marker wherever the decoded text holds it, however the tokenizer split it.

    ``decode`` turns a few token ids into text (special tokens kept). Each token
    decodes to at least one character for the tokenizers we serve, so an
    occurrence covers at most ``len(text)`` tokens; the window adds slack for
    tokenizers that drop a leading space when decoding a slice.
    """

    def __init__(self, text: str, decode: Callable[[list[int]], str]) -> None:
        if not text:
            raise ValueError("a reasoning marker must not be empty")
        self.text = text
        self.decode = decode
        self.window = len(text) + 2

    @property
    def span(self) -> int:
        return self.window

    def _ends_at(self, tokens: Sequence[int], end: int) -> bool:
        """An occurrence completes inside token ``end - 1``."""
        lo = max(0, end - self.window)
        with_last = self.decode(list(tokens[lo:end])).count(self.text)
        return with_last > 0 and with_last > self.decode(list(tokens[lo : end - 1])).count(self.text)

    def _present(self, tokens: Sequence[int], lo: int, hi: int) -> bool:
        return self.text in self.decode(list(tokens[max(0, lo - self.window) : hi]))

    def last_end(self, tokens: Sequence[int], lo: int, hi: int) -> int:
        if hi <= lo or not self._present(tokens, lo, hi):
            return -1
        for end in range(hi, lo, -1):
            if self._ends_at(tokens, end):
                return end
        return -1

    def first_end(self, tokens: Sequence[int], lo: int) -> int:
        hi = len(tokens)
        if hi <= lo or not self._present(tokens, lo, hi):
            return -1
        for end in range(lo + 1, hi + 1):
            if self._ends_at(tokens, end):
                return end
        return -1


def as_marker(marker: Marker | Sequence[int]) -> Marker:
    """A list of ids is an exact ``TokenMarker``; a marker passes through."""
    if hasattr(marker, "last_end"):
        return marker  # type: ignore[return-value]
    return TokenMarker(marker)  # type: ignore[arg-type]

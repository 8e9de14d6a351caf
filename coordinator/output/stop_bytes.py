"""A cheap, exact test that a token cannot have completed a stop string.

With a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2 ...) the decoded text of a
sequence is the UTF-8 decoding of its tokens' bytes, concatenated. A stop string found in
the text is then found in those bytes (unless it contains U+FFFD, which decoding also writes
for invalid bytes: rows with such a stop string are always checked exactly), so when the bytes near the end of a row's output hold
none of its stop strings, the incremental detokenizer's check (``find_stop``) would find none
either, and decoding that row can wait until its output is built. Only rows whose bytes might
hold a stop run the exact check, on the critical path. The byte table is checked against the
tokenizer itself at start-up; a tokenizer it does not describe gets no table, and every row
with stop strings is detokenized token by token, as before.
"""

from __future__ import annotations

import random
from typing import Any

MAX_CHAR_BYTES = 4


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 bytes (the ByteLevel pre-tokenizer's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_bytes(tokenizer: Any, skip_special_tokens: bool = True, checks: int = 200) -> list[bytes] | None:
    """Each token id's bytes, or None when decoding is not a concatenation of them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    alphabet = _byte_level_alphabet()
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = [b""] * size
    special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    for piece, index in backend.get_vocab(with_added_tokens=True).items():
        if index >= size:
            return None
        if piece in special and skip_special_tokens:
            continue
        table[index] = bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode()
    rng = random.Random(0)
    for _ in range(checks):  # the table must decode as the tokenizer does
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 12))]
        want = backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if b"".join(table[i] for i in ids).decode("utf-8", errors="replace") != want:
            return None
    return table


def complete_utf8(table: list[bytes]) -> list[bool]:
    """Per token id: its bytes decode to whole characters by themselves (nothing held back)."""
    out = []
    for piece in table:
        try:
            piece.decode("utf-8")
            out.append(True)
        except UnicodeDecodeError:
            out.append(False)
    return out


class StopScanner:
    """One row's output bytes (a bounded tail) and its stop strings as bytes.

    The caller skips the exact check only for a token whose bytes are complete UTF-8 on their
    own (``complete_utf8``) while the detokenizer holds nothing back (``dirty`` is False): that
    token's new text is then exactly its own bytes decoded, so ``find_stop``'s window (the new text and ``max_stop_chars - 1`` characters
    before it) lies within the last ``len(token bytes) + slack`` bytes searched here.
    """

    __slots__ = ("buffer", "synced", "stops", "slack", "dirty")

    def __init__(self, stops: list[str], max_stop_chars: int) -> None:
        self.buffer = bytearray()
        self.synced = 0  # output tokens whose bytes are in the buffer
        self.stops = [s.encode() for s in stops]
        self.slack = MAX_CHAR_BYTES * (max_stop_chars + 1)
        self.dirty = False  # the detokenizer held text back at its last exact push

    def may_stop(self, table: list[bytes], output: list[int], last_token_bytes: int) -> bool:
        """False only if no stop string lies in the bytes ``find_stop`` would search."""
        buffer = self.buffer
        buffer += b"".join([table[t] for t in output[self.synced :]])
        self.synced = len(output)
        if len(buffer) > 8192:
            del buffer[:-4096]
        start = len(buffer) - last_token_bytes - self.slack
        start = start if start > 0 else 0
        for stop in self.stops:
            if buffer.find(stop, start) != -1:
                return True
        return False

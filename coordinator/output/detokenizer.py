"""Incremental detokenization with stop strings.

Text grows token by token without re-decoding the whole output. With a Rust
(fast) tokenizer that is ``tokenizers.decoders.DecodeStream``, primed with the
last prompt tokens so spacing comes out as in a full decode; it holds back an
incomplete UTF-8 sequence until a later token completes it. Tokenizers without
a Rust backend (or whose transformers wrapper cleans up spaces) decode the
tokens since the last boundary with a few tokens of context instead.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The Rust tokenizer directly, when transformers would add nothing on top of it.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None
        self.tokens: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.consumed = 0  # output tokens pushed so far
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self._stream = (DecodeStream(ids=self.tokens, skip_special_tokens=skip_special_tokens)
                        if self._backend is not None else None)
        self.text = ""
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completed (maybe empty)."""
        self.tokens.append(token_id)
        self.consumed += 1
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if not delta:
                return ""
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += delta
            return delta
        before = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
            delta = after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += delta
            return delta
        return ""

    def push_and_check(self, token_id: int, check: bool) -> str | None:
        """``push`` then, when ``check`` and the token completed text, ``find_stop`` on it: the
        stop string it completed, if any. One call per row per step on the coordinator's
        critical path, so the Rust stream's common case is inlined."""
        stream = self._stream
        if stream is None:
            delta = self.push(token_id)
        else:
            self.tokens.append(token_id)
            self.consumed += 1
            delta = stream.step(self._backend, token_id)
            if not delta:
                return None
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += delta
        if not check or not delta:
            return None
        text = self.text
        window_start = len(text) - len(delta) - self.max_stop_len + 1
        best = -1
        found = None
        for s in self.stop:
            at = text.find(s, window_start if window_start > 0 else 0)
            if at != -1 and (best == -1 or at < best):
                best, found = at, s
        if found is not None:
            self.text = text[: best + len(found)] if self.include_stop else text[:best]
        return found

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Push the output tokens not pushed yet: without stop strings, text is only needed
        when an output is built, so the step loop leaves decoding to then."""
        for token_id in output_token_ids[self.consumed:]:
            self.push(token_id)

    def flush(self) -> str:
        """At the end, emit whatever is pending, even an incomplete character (the stream never would)."""
        before = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset :])
        delta = after[len(before) :] if len(after) > len(before) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += delta
        return delta

    def find_stop(self, new_chars: int) -> str | None:
        """If a stop string ends within the last ``new_chars`` characters, cut the text there."""
        if not self.stop or not new_chars:
            return None
        window_start = max(0, len(self.text) - new_chars - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back what could still become a stop string."""
        if finished or not self.stop or self.include_stop:
            return self.text
        return self.text[: max(0, len(self.text) - (self.max_stop_len - 1))]

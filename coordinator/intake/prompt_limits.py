"""The longest text that can still fit in ``max_model_len`` tokens: refuse longer ones before tokenizing.

No token of a tokenizer stands for more characters than its longest vocabulary entry (a byte-level
BPE entry is one character per byte; added tokens such as ``<|im_start|>`` count as they are
spelled), so a text longer than ``max_model_len`` times that, times a margin for normalizers that
shorten text, cannot fit. Checking the length costs nothing; tokenizing a 50 MB line first cost
9 GiB and over a minute.
"""

from __future__ import annotations

from typing import Any

NORMALIZER_MARGIN = 4


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (at least 1); computed once by each user."""
    return max(map(len, tokenizer.get_vocab()), default=1) or 1


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """A text with more characters than this is longer than ``max_model_len`` tokens, whatever it says."""
    return max_model_len * longest_token_chars(tokenizer) * NORMALIZER_MARGIN


def check_prompt_chars(text: str, limit: int, max_model_len: int, what: str = "prompt") -> None:
    """ValueError when ``text`` cannot fit (see the module docstring)."""
    if len(text) > limit:
        raise ValueError(too_long_message(len(text), limit, max_model_len, what))


def too_long_message(chars: int, limit: int, max_model_len: int, what: str = "prompt") -> str:
    return (f"{what} has {chars} characters: more than fit in max_model_len={max_model_len} tokens "
            f"(at most {limit} characters for this tokenizer); it was refused before tokenizing")

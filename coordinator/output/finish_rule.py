"""When a request finishes: the one rule, for a new token of each row.

In order: length (``max_tokens``, or ``max_model_len`` for prompt + output) wins;
then, once ``min_tokens`` are out, EOS (unless ``ignore_eos``), then a token of
``stop_token_ids``. A stop string is checked on the detokenized text, also only
past ``min_tokens``; it wins over all of them and cuts the text.

Works on arrays of rows (the step's fast paths) and on one row (0-d values):
every path that accepts tokens asks it, so they cannot disagree.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class TokenFinish(NamedTuple):
    length: np.ndarray  # the row is at its length limit
    eos: np.ndarray  # the token is the row's EOS, past min_tokens (and not a length finish)
    stop_ids_apply: np.ndarray  # neither: a token in stop_token_ids would finish the row


def token_finish(total: np.ndarray, limit: np.ndarray, min_total: np.ndarray, token: np.ndarray,
                 eos: np.ndarray) -> TokenFinish:
    """``total``: prompt + output tokens with the new ``token``; ``limit``: the total at which
    the row stops for length; ``min_total``: prompt + min_tokens; ``eos``: -1 for none or
    ``ignore_eos`` (``coordinator.schedule.slot_table`` keeps these per slot)."""
    length = total >= limit
    past_min = total >= min_total
    eos_hit = ~length & past_min & (token == eos)
    return TokenFinish(length, eos_hit, ~length & ~eos_hit & past_min)


def stop_strings_apply(total: np.ndarray, min_total: np.ndarray) -> np.ndarray:
    """Whether text ending with this token may complete a stop string (only past min_tokens)."""
    return total > min_total

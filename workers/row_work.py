"""One row's work in a forward pass: the message from the worker to the model runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RowWork:
    """One row's work this step: feed ``token_ids`` at positions ``start_pos..``; logits for the last ``num_logits``.

    ``block_table`` must cover every position up to ``start_pos + len(token_ids)``. ``decode``: the row
    feeds its last generated token (and drafts after it), not a prompt chunk. Attention for the two
    runs in different kernels on CPU (the decode kernel, SDPA); choosing by what the tokens are, not
    by how many a step feeds, computes a prompt token the same way whether its prompt came in one
    chunk, in several or after a prefix-cache hit, so a seeded request's output does not depend on
    the batch in bfloat16 either (where the two kernels round differently).
    """

    block_table: list[int]
    token_ids: list[int]
    start_pos: int
    num_logits: int = 1
    decode: bool = False
    adapter: tuple[int, str] | None = None  # the row's LoRA adapter: (id, directory), or None for the base model

"""Bad words: ban the last token of a banned sequence when the output ends with its prefix."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from processors.digest import dict_items_sorted, digest_of
from processors.interface import BatchUpdate
from processors.row_columns import upload
from processors.rowwise_processor import RowwiseLogitsProcessor
from processors.sampling_params import SamplingParams
from processors.state import process_dict_updates


def bad_words_token_ids(params: SamplingParams) -> list[list[int]]:
    """The token-id form the processor consumes (set at admission by ``update_from_tokenizer``)."""
    if params.bad_words and params.bad_words_token_ids is None:
        raise ValueError("bad_words were given but not tokenized; the engine calls update_from_tokenizer at admission.")
    return params.bad_words_token_ids or []


class BadWordsLogitsProcessor(RowwiseLogitsProcessor):
    """Bans ``seq[-1]`` whenever the output ends with ``seq[:-1]`` (output tokens only, as vLLM)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        # row -> (token-id sequences, live output list)
        self.bad_words: dict[int, tuple[list[list[int]], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: SamplingParams, _: Any, output: list[int]):
            sequences = bad_words_token_ids(params)
            return (sequences, output) if sequences else None

        process_dict_updates(self.bad_words, batch_update, new_state)

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        if not self.bad_words:
            return logits
        ban_rows: list[int] = []
        ban_toks: list[int] = []
        for index, (sequences, output) in self.bad_words.items():
            if not rows.start <= index < rows.stop:
                continue
            for seq in sequences:
                prefix_len = len(seq) - 1
                if prefix_len > len(output):
                    continue
                if prefix_len == 0 or output[-prefix_len:] == seq[:-1]:
                    ban_rows.append(index - rows.start)
                    ban_toks.append(seq[-1])
        if ban_rows:
            index = (upload(np.asarray(ban_rows, dtype=np.int64), logits.device),
                     upload(np.asarray(ban_toks, dtype=np.int64), logits.device))
            logits.index_put_(index, logits.new_full((), float("-inf")))
        return logits

    def state_digest(self) -> bytes:
        return digest_of("bad_words", [(i, seqs, len(out)) for i, (seqs, out) in dict_items_sorted(self.bad_words)])

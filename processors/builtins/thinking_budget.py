"""Thinking budget: cap the tokens a request spends between the reasoning start and end sequences.

``ThinkingBudgetStateHolder`` sits beside the processors and follows the same
BatchUpdate stream (``sync_batch``). Unlike vLLM's holder, whose countdown
state machine drifts under speculative decoding, every decision here is a
pure function of the row's tokens (prompt + output, plus any draft tokens
appended for the position being processed):

- thinking is open when the last start sequence comes after the last end
  sequence (a prompt that opened thinking counts: its tokens after the start
  use up budget);
- the ``len(end)`` positions from ``budget`` tokens after that start (or from
  the first generated token, if the prompt alone spent the budget) are forced
  to the end sequence, token by token, so exactly ``budget`` thinking tokens
  precede it;
- a natural end closes thinking, and a new start re-arms the full budget.

A forced row keeps only the forced token finite, so it is sampled whatever the
temperature, and a rejected draft is replaced by it. Requests without a budget
cost nothing. Scans are incremental over the committed tokens; drafts are
scanned separately and never cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from processors.digest import digest_of
from processors.interface import BatchUpdate, MoveDirectionality
from processors.markers import Marker, TextMarker, TokenMarker, as_marker
from processors.row_columns import upload


@dataclass
class _RowState:
    budget: int
    prompt: list[int]
    output: list[int]  # live list
    scanned: int = 0  # committed tokens (prompt + output) already scanned
    last_start: int = -1  # end index of the last start sequence in prompt + output
    last_end: int = -1  # end index of the last end sequence


class ThinkingBudgetStateHolder:
    """``start`` / ``end``: markers (or exact id lists); ``forced_end``: the ids forced when the budget
    is spent (default: the end marker's ids, which an id-list end has)."""

    def __init__(self, start: Marker | list[int], end: Marker | list[int], max_num_seqs: int,
                 device: torch.device | str = "cpu", forced_end: list[int] | None = None) -> None:
        self.start, self.end = as_marker(start), as_marker(end)
        if forced_end is None:
            if not isinstance(self.end, TokenMarker):
                raise ValueError("a text end marker needs the token ids to force (forced_end)")
            forced_end = self.end.ids
        if not forced_end:
            raise ValueError("the reasoning end must tokenize to at least one token")
        self.forced_end = list(forced_end)
        self.max_num_seqs = max_num_seqs
        self.device = torch.device(device)
        self._state: dict[int, _RowState] = {}

    def has_tracked_requests(self) -> bool:
        return bool(self._state)

    def sync_batch(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self._state.pop(index, None)
        for index, params, prompt, output in batch_update.added:
            budget = params.thinking_token_budget
            if budget is None:
                self._state.pop(index, None)
            else:
                self._state[index] = _RowState(budget, list(prompt or []), output)
        for a, b, direction in batch_update.moved:
            state_a, state_b = self._state.pop(a, None), self._state.pop(b, None)
            if state_a is not None:
                self._state[b] = state_a
            if direction == MoveDirectionality.SWAP and state_b is not None:
                self._state[a] = state_b

    # The holder is also a pipeline stage: same stream, same calls as processors.
    update_state = sync_batch

    def _scan(self, state: _RowState, tokens: list[int], start: int, stop: int) -> tuple[int, int]:
        """(last start, last end) after scanning sequence ends in (start, stop]."""
        return self.start.last_end(tokens, start, stop), self.end.last_end(tokens, start, stop)

    def _committed(self, state: _RowState, committed: int) -> tuple[int, int]:
        """Advance the cached scan to ``committed`` tokens (never includes drafts)."""
        if committed > state.scanned:
            tokens = state.prompt + state.output[: committed - len(state.prompt)]
            overlap = max(self.start.span, self.end.span) - 1
            s, e = self._scan(state, tokens, max(0, state.scanned - overlap), committed)
            if s != -1:
                state.last_start = max(state.last_start, s)
            if e != -1:
                state.last_end = max(state.last_end, e)
            state.scanned = committed
        return state.last_start, state.last_end

    def forced_token(self, state: _RowState, num_drafts: int = 0) -> int | None:
        """The token this row must take next, or None. ``num_drafts``: trailing output tokens that are drafts."""
        committed = len(state.prompt) + len(state.output) - num_drafts
        last_start, last_end = self._committed(state, committed)
        total = committed + num_drafts
        if num_drafts:
            tokens = state.prompt + state.output
            overlap = max(self.start.span, self.end.span) - 1
            s, e = self._scan(state, tokens, max(0, committed - overlap), total)
            last_start, last_end = max(last_start, s), max(last_end, e)
        if last_start == -1 or last_end > last_start:
            return None
        # Forcing starts once the budget is spent, or at the first generated token
        # when the prompt alone already spent it.
        force_from = max(last_start + state.budget, len(state.prompt))
        if force_from <= total < force_from + len(self.forced_end):
            return self.forced_end[total - force_from]
        return None

    def forced_rows(self, rows: slice, num_drafts: dict[int, int] | None = None) -> dict[int, int]:
        """{batch row: forced token} for tracked rows in ``rows``."""
        out = {}
        for index, state in self._state.items():
            if rows.start <= index < rows.stop:
                token = self.forced_token(state, (num_drafts or {}).get(index, 0))
                if token is not None:
                    out[index] = token
        return out

    def apply_rows(self, logits: torch.Tensor, rows: slice, num_drafts: dict[int, int] | None = None) -> torch.Tensor:
        if not self._state:
            return logits
        forced = self.forced_rows(rows, num_drafts)
        if forced:
            local = upload(np.asarray([i - rows.start for i in forced], dtype=np.int64), logits.device)
            tokens = upload(np.asarray(list(forced.values()), dtype=np.int64), logits.device)
            logits[local] = float("-inf")
            logits[local, tokens] = 0.0
        return logits

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.apply_rows(logits, slice(0, logits.shape[0]))

    def is_argmax_invariant(self) -> bool:
        return False

    def state_digest(self) -> bytes:
        return digest_of(
            "thinking_budget",
            [(i, s.budget, len(s.prompt), len(s.output)) for i, s in sorted(self._state.items())],
        )


def maybe_thinking_budget_holder(reasoning: Any, tokenizer: Any, max_num_seqs: int,
                                 device: torch.device | str = "cpu") -> ThinkingBudgetStateHolder | None:
    """A holder when the config has a ``reasoning`` section, else None.

    Markers given as strings match the decoded text, however the tokenizer splits them after
    other text; ``start_token_ids`` / ``end_token_ids`` match those exact ids instead.
    """
    if reasoning is None:
        return None
    start, end, forced_end = reasoning_markers(reasoning, tokenizer)
    return ThinkingBudgetStateHolder(start, end, max_num_seqs, device, forced_end=forced_end)


def reasoning_markers(reasoning: Any, tokenizer: Any) -> tuple[Marker, Marker, list[int]]:
    """(start marker, end marker, ids forced to end thinking) from a ``reasoning`` config section."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def marker(text: str, ids: list[int] | None) -> Marker:
        return TokenMarker(ids) if ids else TextMarker(text, decode)

    start_ids = getattr(reasoning, "start_token_ids", None)
    end_ids = getattr(reasoning, "end_token_ids", None)
    forced = list(end_ids) if end_ids else tokenizer.encode(reasoning.end, add_special_tokens=False)
    if not forced:
        raise ValueError(f"reasoning end {reasoning.end!r} tokenizes to no tokens")
    return marker(reasoning.start, start_ids), marker(reasoning.end, end_ids), forced

"""Running request-level logits processors (vLLM V0 style callables) in the batch model."""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any, Union

import torch

from processors.digest import digest_of
from processors.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
from processors.sampling_params import SamplingParams
from processors.state import process_dict_updates

RequestLogitsProcessor = Union[
    # (output token ids, logits row) -> logits row
    Callable[[list[int], torch.Tensor], torch.Tensor],
    # (prompt token ids, output token ids, logits row) -> logits row
    Callable[[list[int], list[int], torch.Tensor], torch.Tensor],
]


class RequestConstructionError(RuntimeError):
    """Per-request processors could not be built for ``rows`` (batch rows after the update)."""

    def __init__(self, rows: list[int], cause: BaseException) -> None:
        super().__init__(f"the per-request processor of row(s) {rows} could not be built "
                         f"({type(cause).__name__}: {cause})")
        self.rows = rows


def final_rows(rows: list[int], batch_update: BatchUpdate) -> list[int]:
    """Where rows named at their add end up after the update's moves."""
    at = set(rows)
    for a, b, direction in batch_update.moved:
        has_a, has_b = a in at, b in at
        at.discard(a)
        at.discard(b)
        if has_a:
            at.add(b)
        if has_b and direction == MoveDirectionality.SWAP:
            at.add(a)
    return sorted(at)


class AdapterLogitsProcessor(LogitsProcessor):
    """Base class that wraps a per-request callable into a batch processor.

    Subclasses implement ``is_argmax_invariant`` and
    ``new_req_logits_processor(params)``, which returns the callable for one
    request or ``None`` to leave that request alone. The callable gets the
    request's live token lists and one logits row; it may edit the row in
    place or return a new one.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # row -> callable with the token lists already bound (by reference).
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> partial[torch.Tensor] | None:
        req_lp = self.new_req_logits_processor(params)
        if not req_lp:  # as vLLM: a falsy callable means "not for this request"
            return None
        if len(inspect.signature(req_lp).parameters) == 3:
            if prompt_ids is None:
                raise ValueError(
                    f"{type(self).__name__}: this request-level processor takes prompt token ids, "
                    "but the request has none."
                )
            return partial(req_lp, prompt_ids, output_ids)
        return partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            process_dict_updates(self.req_info, batch_update, self._new_state)
            return
        # Build each added request's callable first, so one that fails is known by its row.
        built, failed, first_error = [], [], None
        for index, params, prompt, output in batch_update.added:
            try:
                built.append(self._new_state(params, prompt, output))
            except Exception as exc:
                built.append(None)
                failed.append(index)
                first_error = first_error or exc
        states = iter(built)
        process_dict_updates(self.req_info, batch_update, lambda *_: next(states))
        if failed:
            raise RequestConstructionError(final_rows(failed, batch_update), first_error) from first_error

    def _apply_entries(self, logits: torch.Tensor, start: int) -> torch.Tensor:
        stop = start + logits.shape[0]
        for index, req_lp in self.req_info.items():
            if not start <= index < stop:
                continue
            row = logits[index - start]
            new_row = req_lp(row)
            if new_row is not row:
                logits[index - start] = new_row
        return logits

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.req_info:
            self._apply_entries(logits, 0)
        return logits

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        if self.req_info:
            self._apply_entries(logits, rows.start)
        return logits

    def state_digest(self) -> bytes:
        # The wrapped callables are opaque; which rows are on, with which callable
        # type and how long their output is, is what replicas must agree on.
        return digest_of(
            type(self).__qualname__,
            [
                (i, type(lp.func).__qualname__, len(lp.args[-1]))
                for i, lp in sorted(self.req_info.items(), key=lambda kv: kv[0])
            ],
        )

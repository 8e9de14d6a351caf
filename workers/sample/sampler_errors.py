"""What the sampler says when a row cannot be sampled, and whose fault it was.

A processor that raises, returns the wrong shape or leaves a row with no finite logit fails that
row alone; these name the processor and the stage (the model, the request's constraints, a
processor) so the error a user reads points at the cause.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from processors import LogitsProcessor


class LogitsProcessorError(RuntimeError):
    """A processor raised while the sampler ran it; the message names the processor.

    ``rows``: the batch rows whose requests enable that processor, when that can be known
    (request-level adapters, slot-keyed processors); ``None`` means the whole step's batch.
    """

    def __init__(self, message: str, rows: tuple[int, ...] | None = None) -> None:
        super().__init__(message)
        self.rows = rows

    def __reduce__(self):  # keep ``rows`` across processes (Ray)
        return type(self), (self.args[0], self.rows)


def check_logits(out: Any, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a processor returns must be logits like its input: same shape, dtype and device."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"apply returned {type(out).__name__}, not a tensor")
    if out.shape != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"apply returned a {out.dtype} tensor of shape {tuple(out.shape)} on {out.device}; "
                         f"expected {dtype} {tuple(shape)} on {device}")
    return out


def checked_apply(proc: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
    shape, dtype, device = logits.shape, logits.dtype, logits.device
    return check_logits(proc.apply(logits), shape, dtype, device)


MODEL_STAGE = "the model's forward"
CONSTRAINTS_STAGE = "this request's constraints"


class BadRowTracker:
    """Which stage first left each row with a non-finite maximum: the model's logits, the constraint
    stages and each user processor's output are checked (one ``amax`` each; builtins are fed
    validated parameters). A row found bad is set to zeros, so no later stage trips over it (it is
    condemned already). Kept on the device; read only when some row went bad."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.first: torch.Tensor | None = None  # (rows,) index into names, -1 while the row is fine
        self.value: torch.Tensor | None = None  # (rows,) the row's maximum when it was found bad

    def check(self, name: str, logits: torch.Tensor) -> None:
        row_max = logits.amax(dim=-1)
        bad = ~torch.isfinite(row_max)
        if self.first is None:
            self.first = torch.full(bad.shape, -1, dtype=torch.int32, device=bad.device)
            self.value = torch.zeros_like(row_max)
        new = (self.first < 0) & bad
        self.first = torch.where(new, len(self.names), self.first)
        self.value = torch.where(new, row_max, self.value)
        self.names.append(name)
        logits.masked_fill_(bad.unsqueeze(1), 0.0)

    def stage_of(self, local_row: int) -> str | None:
        if self.first is None:
            return None
        index = int(self.first[local_row])
        return self.names[index] if index >= 0 else None


def describe_bad_row(row_max: float, stage: str | None) -> str:
    """Why a row cannot be sampled, from its maximum logit and the first stage that left it so."""
    if math.isnan(row_max):
        what = "its logits contain NaN"
    elif row_max > 0:
        what = "its logits contain +inf"
    else:
        what = "every token is masked (-inf)"
    if stage == MODEL_STAGE:
        where = f" in {MODEL_STAGE}"
    elif stage == CONSTRAINTS_STAGE or (stage is None and row_max < 0):
        where = f" by {CONSTRAINTS_STAGE} (allowed_token_ids, bad_words, structured outputs, ...)"
    elif stage is not None:
        where = f" after logits processor {stage}"
    else:
        where = ""
    return f"this request cannot be sampled: {what}{where}; the other requests of the step were not affected"


def row_errors(row_max: torch.Tensor, rows: slice, tracker: BadRowTracker | None,
               only: torch.Tensor | None = None, model_faults: list[int] | None = None) -> dict[int, str]:
    """Batch row -> why, for the rows of the call whose maximum is not finite or that the tracker
    found bad (one check when none is). ``only``: a mask of the rows to consider. ``model_faults``:
    receives the rows that the model's forward left NaN or +inf (no processor or constraint did)."""
    bad = ~torch.isfinite(row_max)
    if tracker is not None and tracker.first is not None:
        found = tracker.first >= 0
        bad |= found
        row_max = torch.where(found, tracker.value, row_max)
    if only is not None:
        bad &= only
    if not bool(bad.any()):
        return {}
    local = bad.nonzero().flatten().tolist()
    maxima = row_max[bad].tolist()
    stages = [tracker.stage_of(i) if tracker is not None else None for i in local]
    if model_faults is not None:
        model_faults += [rows.start + i for i, value, stage in zip(local, maxima, stages)
                         if stage == MODEL_STAGE or (stage is None and not value < 0)]  # NaN or +inf
    return {rows.start + i: describe_bad_row(value, stage) for i, value, stage in zip(local, maxima, stages)}


def processor_name(proc: object) -> str:
    cls = type(proc)
    return f"{cls.__module__}.{cls.__qualname__}"

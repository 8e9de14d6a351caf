"""A step's sample on its way to the host: the device work is queued by ``Sampler.sample``, and
``PendingSample.finish`` makes the step's first read (the sampled ids), then the rows that could not
be sampled and the logprobs; on a GPU the host waits once, for the whole step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from workers.sample.sampler_errors import BadRowTracker, row_errors
from workers.wire import TokenLogprobs


class LogprobsSource(Protocol):
    """The sampler, as far as finishing a sample needs it."""

    def logprobs(self, raw: torch.Tensor, local: np.ndarray, rows: slice,
                 sampled: torch.Tensor) -> dict[int, TokenLogprobs]: ...


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # (num_rows,) int64, rows of the call in order
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by persistent-batch row
    # Rows that cannot be sampled (NaN, +inf, or every token masked), by persistent-batch row: why.
    # Their token is 0 and must not be used; every other row sampled as if they were not there.
    errors: dict[int, str] = field(default_factory=dict)
    # Of those, the rows whose logits were NaN or +inf out of the model's forward: no request's setting
    # makes them so, the engine may be at fault (``Worker.self_check`` tells).
    model_faults: list[int] = field(default_factory=list)


@dataclass
class PendingSample:
    """A step's draw as the device computes it; ``finish`` reads it. The sampled ids are the first read,
    so on a GPU the host waits once, for the whole step; the rows that could not be sampled and the
    logprobs are read after them."""

    sampler: LogprobsSource
    sampled: torch.Tensor  # (rows,) on the device
    row_max: torch.Tensor  # (rows,) each row's maximum: not finite where the row cannot be sampled
    tracker: BadRowTracker | None
    rows: slice
    raw: torch.Tensor | None  # the model's logits of the rows that asked for logprobs
    logprob_local: np.ndarray

    def finish(self) -> SamplerOutput:
        sampler, rows = self.sampler, self.rows
        tokens = self.sampled.to("cpu", torch.int64)  # the step's first host read
        faults: list[int] = []
        errors = row_errors(self.row_max, rows, self.tracker, model_faults=faults)
        if errors:
            tokens[[r - rows.start for r in errors]] = 0
        out = SamplerOutput(sampled_token_ids=tokens, errors=errors, model_faults=faults)
        if self.raw is not None:
            out.logprobs = sampler.logprobs(self.raw, self.logprob_local, rows, tokens)
            for row in errors:
                out.logprobs.pop(row, None)
        return out

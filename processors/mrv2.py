"""vLLM's Model Runner V2 logits-processor interface: state keyed by request slot.

A processor written for ``vllm.v1.worker.gpu.sample.logits_processor`` runs
here after changing its imports to ``processors.mrv2``. It is constructed as
``cls(vllm_config, req_states)``, told of each request entering a slot
(``add_request``, whose return value says whether it edits that request's
logits), flushed once per step (``apply_staged_writes``) and applied to the
logits rows of a step with a ``LogitsContext`` that maps rows to slots.

Committed tokens live in ``req_states.all_token_ids`` up to ``total_len``;
under speculative decoding a request owns one logits row per draft position
and its draft tokens are only in ``ctx.input_ids``, as in vLLM. Layout of a
request's rows ``j = 0..k`` (``expanded_local_pos``): row ``j`` samples the
token after input position ``pos = total_len - 1 + j``; its input token is the
last committed token for ``j = 0`` and draft ``j`` after that, so ``pos + 1``
tokens are visible to what it samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from processors.sampling_params import SamplingParams


class SlotBuffer:
    """A per-slot buffer with vLLM's two views: ``.np`` on the host and ``.gpu`` on the device.

    On a CPU device both views share memory; on a GPU the engine copies host writes over
    once per step (``sync``), before ``apply_staged_writes``.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, device: torch.device) -> None:
        self.np = np.zeros(shape, dtype=dtype)
        host = torch.from_numpy(self.np)
        self.gpu = host if device.type == "cpu" else host.to(device)
        self._device = device

    def sync(self) -> None:
        if self._device.type != "cpu":
            self.gpu.copy_(torch.from_numpy(self.np), non_blocking=False)


@dataclass(frozen=True)
class LogitsProcRequestState:
    """Per-slot request state shared with processors; read-only for them (as vLLM's)."""

    device: torch.device
    max_num_reqs: int
    vocab_size: int
    all_token_ids: SlotBuffer  # [max_num_reqs, max_model_len] committed tokens of each slot
    prompt_len: SlotBuffer  # [max_num_reqs]
    prefill_len: SlotBuffer  # [max_num_reqs] tokens fed at the latest (re)fill: prompt + output so far
    total_len: SlotBuffer  # [max_num_reqs] prompt + committed output


@dataclass(frozen=True)
class LogitsContext:
    """The rows of one ``apply`` call (vLLM's field names and meanings)."""

    expanded_idx_mapping: torch.Tensor  # [num_logits_rows] row -> request slot
    idx_mapping: torch.Tensor  # [num_reqs] request position -> slot
    idx_mapping_np: np.ndarray
    expanded_local_pos: torch.Tensor  # [num_logits_rows] row's offset among its request's rows
    input_ids: torch.Tensor  # [num_logits_rows] token fed at each row's input position
    pos: torch.Tensor  # [num_logits_rows] position of that input token
    seq_lens_upper_bound_np: np.ndarray  # [num_reqs] tokens visible to the sampled token


class LogitsProcessor(ABC):
    """Base class of a slot-keyed (Model Runner V2) processor; see vLLM's documentation.

    ``apply`` runs after allowed-token, bad-words, batch-level custom processors and
    penalties, before thinking-budget forcing, temperature, min-p and top-k/top-p.
    """

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:  # noqa: B027
        """Capture what stays constant for the processor's lifetime."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:  # noqa: B027
        """Raise ``ValueError`` for invalid per-request arguments (runs at admission)."""

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """(Re)initialize slot ``req_idx``; return whether this processor edits its logits."""
        return True

    def apply_staged_writes(self) -> None:  # noqa: B027
        """Flush host-side writes staged by ``add_request`` (once per step)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """Edit ``logits`` (``[num_logits_rows, vocab]`` float32) in place or return a new tensor."""
        raise NotImplementedError

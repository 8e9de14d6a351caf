"""The batch-level logits processor contract (vLLM V1 semantics).

A processor sees the persistent batch as rows ``0..batch_size-1``. Before every
step it receives one ``BatchUpdate`` (or ``None`` when nothing changed) and must
process its operations in the order removes, adds, moves. It then transforms a
``(num_rows, vocab_size)`` float32 logits tensor in ``apply``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from processors.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    # One-way i1 -> i2 move; i1 becomes empty, whatever was at i2 is discarded.
    UNIDIRECTIONAL = auto()
    # Two-way i1 <-> i2 swap.
    SWAP = auto()


# (index, params, prompt token ids, output token ids). The output list is the
# request's live list: processors that keep the reference see it grow.
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]

# (from index, to index, directionality), applied in list order after adds.
MovedRequest = tuple[int, int, MoveDirectionality]

# Index of a request removed without replacement.
RemovedRequest = int


@dataclass(frozen=True)
class BatchUpdate:
    """Changes to the persistent batch since the previous step.

    ``batch_size`` is the number of occupied rows after all operations. The
    index of an add is the index at the time of the add, before any move.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Base class of every batch-level logits processor.

    Required (as in vLLM):

    - ``__init__(config, device, is_pin_memory)``. ``config`` exposes at least
      ``config.scheduler_config.max_num_seqs`` and ``config.speculative_config``
      (``None`` when speculative decoding is off).
    - ``apply(logits)``: transform ``(num_rows, vocab)`` logits, in place or
      not, and return them. Rows of requests that do not enable the processor
      must come back unchanged.
    - ``is_argmax_invariant()``: ``True`` if the processor never changes a
      row's argmax; such processors are skipped when the whole batch is greedy.
    - ``update_state(batch_update)``: digest one step's ``BatchUpdate``
      (removes, then adds, then moves); ``None`` means no membership change,
      though output lists held by reference may have grown.
    - ``validate_params(params)`` (classmethod, optional): raise ``ValueError``
      for a request whose parameters this processor cannot accept.

    Optional extensions of raysample (looked up with ``getattr``; a processor
    without them still works everywhere):

    - ``apply_rows(logits, rows: slice)``: ``logits`` holds only the
      persistent-batch rows ``rows`` (row ``rows.start`` is ``logits[0]``).
      Lets a worker transform just its shard. Without it the worker calls
      ``apply`` on a full-batch view whose rows outside the shard are filler.
    - ``state_digest() -> bytes``: a deterministic digest of the per-row state;
      replicas on different workers must produce equal digests. Used by the
      consistency audit.

    Speculative decoding (n-gram drafts verified in one forward): at draft
    position ``j`` the output lists hold drafts ``0..j-1`` and
    ``update_state(None)`` has been called since they were appended. After
    verification the engine restores the processor to its state from before
    the drafts (a copy taken with the live output lists shared, not copied), so
    a processor whose state is derived from the lists in ``update_state`` is
    exact, including one that deletes entries as lists grow, like vLLM's
    ``MinTokensLogitsProcessor``. Two class attributes change this:

    - ``supports_spec_decode = True``: the processor handles drafts itself; it is
      not copied, and gets ``update_state(None)`` after rejected drafts are
      removed instead.
    - ``incremental_state = True``: its state counts calls or tokens as they come
      (not a function of the lists), so no copy can make it exact: speculative
      decoding is refused at start-up with it unless it also supports it.

    A processor whose state cannot be deep-copied is refused with speculative
    decoding too.
    """

    supports_spec_decode: bool = False
    incremental_state: bool = False

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` if ``sampling_params`` is invalid for this processor."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor never changes which token has the highest logit.

        Not a classmethod: an instance may decide from its configuration.
        """
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every forward pass with that step's batch changes."""
        raise NotImplementedError

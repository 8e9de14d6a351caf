"""Base for stages that act row by row and so implement ``apply`` through ``apply_rows``."""

from __future__ import annotations

from abc import abstractmethod

import torch

from processors.interface import LogitsProcessor


class RowwiseLogitsProcessor(LogitsProcessor):
    """A processor whose every row depends only on that row's state and logits."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.apply_rows(logits, slice(0, logits.shape[0]))

    @abstractmethod
    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        raise NotImplementedError

    @abstractmethod
    def state_digest(self) -> bytes:
        raise NotImplementedError

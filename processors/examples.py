"""Example custom processors: the seed's ``DummyLogitsProcessor`` and a wrapped
request-level processor, written against raysample's imports only.

Both are enabled per request with ``extra_args={"target_token": <id>}`` and
then mask every token but ``target_token``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from processors import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
    SamplingParams,
    process_dict_updates,
)

logger = logging.getLogger(__name__)


def _target_token(params: SamplingParams) -> Any:
    return params.extra_args.get("target_token") if params.extra_args else None


class DummyLogitsProcessor(LogitsProcessor):
    """Keeps only ``extra_args["target_token"]`` for the rows that set it."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = _target_token(sampling_params)
        if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 0):
            raise ValueError(f"target_token must be a non-negative integer token id, got {target!r}.")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index, params, _, _ in batch_update.added:
            target = _target_token(params)
            if target is not None:  # token 0 is a token (vLLM's example tests truthiness and drops it)
                self.req_info[index] = target
            else:
                self.req_info.pop(index, None)
        if not self.req_info:
            return
        for index in batch_update.removed:
            self.req_info.pop(index, None)
        for src, dst, direction in batch_update.moved:
            src_val = self.req_info.pop(src, None)
            dst_val = self.req_info.pop(dst, None)
            if src_val is not None:
                self.req_info[dst] = src_val
            if direction == MoveDirectionality.SWAP and dst_val is not None:
                self.req_info[src] = dst_val

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        kept = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = kept
        return logits


class DummyPerReqLogitsProcessor:
    """A request-level processor: masks everything but ``target_token``."""

    def __init__(self, target_token: int) -> None:
        self.target_token = target_token

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        kept = logits[self.target_token].item()
        logits[:] = float("-inf")
        logits[self.target_token] = kept
        return logits


class WrappedPerReqLogitsProcessor(AdapterLogitsProcessor):
    """``DummyPerReqLogitsProcessor`` run through the adapter."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        target = _target_token(params)
        if target is None:
            return None
        if not isinstance(target, int):
            logger.warning("target_token value %s is not int; not applying logits processor to request.", target)
            return None
        return DummyPerReqLogitsProcessor(target)


class BannedTokensLogitsProcessor(LogitsProcessor):
    """Configured once per engine: ``banned_token_ids`` (constructor kwargs, e.g. from YAML) are
    masked for every request, except those with ``extra_args={"allow_banned": true}``."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool,
                 banned_token_ids: list[int] | None = None) -> None:
        self.banned = torch.tensor(sorted(set(banned_token_ids or [])), dtype=torch.long)
        self.exempt: dict[int, bool] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.exempt, batch_update, lambda params, _, __: True if (params.extra_args or {}).get("allow_banned") else None
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.banned.numel():
            rows = [r for r in range(logits.shape[0]) if r not in self.exempt]
            if rows:
                index = torch.tensor(rows, dtype=torch.long, device=logits.device)
                logits[index.unsqueeze(1), self.banned.to(logits.device).unsqueeze(0)] = float("-inf")
        return logits

"""Processors that raise for tagged requests (the isolation tests load them by name)."""

from __future__ import annotations

import torch

from processors import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, SamplingParams, mrv2, process_dict_updates


def _tag(params: SamplingParams) -> str | None:
    return (params.extra_args or {}).get("boom")


class BoomAdapter(AdapterLogitsProcessor):
    """``boom: "apply"``: its per-request callable raises; ``boom: "build"``: building it raises."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if _tag(params) == "build":
            raise ValueError("cannot build for this request")
        if _tag(params) == "apply":
            def explode(output_ids, logits):
                raise RuntimeError("per-request processor exploded")
            return explode
        return None


class _Tagged(LogitsProcessor):
    """Batch-level: tracks the rows whose ``boom`` tag is ``tag``; subclasses misbehave while any is there."""

    tag = ""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.tagged: dict[int, bool] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.tagged, batch_update, lambda p, _pr, _o: True if _tag(p) == self.tag else None)


class BoomBatch(_Tagged):
    """``boom: "batch"``: raises in apply; it cannot tell which request is to blame."""

    tag = "batch"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tagged:
            raise RuntimeError("batch-level processor exploded")
        return logits


class BoomV2(mrv2.LogitsProcessor):
    """Slot-keyed: enabled (``add_request`` is True) for ``boom: "v2"``, then raises in apply."""

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return _tag(sampling_params) == "v2"

    def apply(self, logits: torch.Tensor, ctx: mrv2.LogitsContext) -> torch.Tensor:
        raise RuntimeError("slot-keyed processor exploded")


class WrongShape(_Tagged):
    """``boom: "shape"``: returns a narrowed tensor while a tagged request is in the batch."""

    tag = "shape"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :100] if self.tagged else logits


class BoomWhenCrowded(_Tagged):
    """``boom: "crowd"``: raises only while two tagged requests share the batch (no one alone is to blame)."""

    tag = "crowd"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if len(self.tagged) >= 2:
            raise RuntimeError("crowded")
        return logits


class ExitsOnce(AdapterLogitsProcessor):
    """``exit_once: <path>``: the first process to see such a request creates ``path`` and dies on the spot
    (a crashed engine process); later ones, finding the file, do nothing."""

    def is_argmax_invariant(self) -> bool:
        return True

    def new_req_logits_processor(self, params: SamplingParams):
        import os

        marker = (params.extra_args or {}).get("exit_once")
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return None


class NonFinite(_Tagged):
    """``boom: "nan"`` / ``"inf"``: that request's row becomes NaN, or gets a +inf, a buggy processor's way."""

    tag = "nan"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row in self.tagged:
            logits[row] = float("nan")
        return logits


class PlusInf(NonFinite):
    tag = "inf"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row in self.tagged:
            logits[row, 7] = float("inf")
        return logits


class BoomLate(_Tagged):
    """``boom: "late"``: raises once this instance has applied to a tagged request three times. A fresh
    instance replaying one request never gets there, so the failure names no request: the engine's
    quarantine must find the culprit."""

    tag = "late"

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.applied = 0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tagged:
            self.applied += 1
            if self.applied >= 3:
                self.applied = 0
                raise RuntimeError("failed for a request it does not name")
        return logits


class HangsAtThirdToken(AdapterLogitsProcessor):
    """``hang: true``: the per-request callable sleeps ``RAYSAMPLE_TEST_HANG_S`` seconds (default 60) when
    its request has three output tokens, as a processor stuck on one request would."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("hang"):
            return None

        def maybe_hang(output_ids, logits):
            if len(output_ids) == 3:
                import os
                import time

                time.sleep(float(os.environ.get("RAYSAMPLE_TEST_HANG_S", "60")))
            return logits
        return maybe_hang


class ExitsAtThirdToken(AdapterLogitsProcessor):
    """``exit: true``: the process running it dies (``os._exit``) when its request has three output tokens."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("exit"):
            return None

        def maybe_exit(output_ids, logits):
            if len(output_ids) == 3:
                import os

                os._exit(3)
            return logits
        return maybe_exit

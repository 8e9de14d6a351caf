"""Custom processors for the speculative-decoding contract tests (loaded by name from configs)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from processors import BatchUpdate, LogitsProcessor, SamplingParams, process_dict_updates


class LengthGateProcessor(LogitsProcessor):
    """``extra_args["gate"] = [token, n]``: ``token`` is banned while the output is shorter than ``n``.

    The per-row decision is computed in ``update_state`` from the live output lists (vLLM's pattern).
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.gates: dict[int, tuple[int, int, list[int]]] = {}
        self.banned: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _gate(params: SamplingParams, _prompt, output: list[int]):
        gate = (params.extra_args or {}).get("gate")
        return None if gate is None else (int(gate[0]), int(gate[1]), output)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.gates, batch_update, self._gate)
        self.banned = {row: tok for row, (tok, n, out) in self.gates.items() if len(out) < n}

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, tok in self.banned.items():
            logits[row, tok] = float("-inf")
        return logits


class VllmMinTokensCopy(LogitsProcessor):
    """vLLM's ``MinTokensLogitsProcessor`` logic, keyed by ``extra_args["vmin"] = [min_tokens, stop_token]``.

    Its ``update_state`` deletes a row's entry once the output reaches ``min_tokens``.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.min_toks: dict[int, tuple[int, Sequence[int], set[int]]] = {}
        self.logits_slice = (torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
        self.neg_inf_tensor = torch.tensor(-float("inf"), dtype=torch.float32, device=device)

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def add_request(params: SamplingParams, _prompt, output_tok_ids: list[int]):
        spec = (params.extra_args or {}).get("vmin")
        if spec is None or len(output_tok_ids) >= spec[0]:
            return None
        return spec[0], output_tok_ids, {spec[1]}

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        needs_update = process_dict_updates(self.min_toks, batch_update, self.add_request)
        if self.min_toks:
            to_remove = tuple(i for i, (min_toks, out, _) in self.min_toks.items() if len(out) >= min_toks)
            if to_remove:
                needs_update = True
                for index in to_remove:
                    del self.min_toks[index]
        if needs_update:
            reqs: list[int] = []
            tok_ids: list[int] = []
            for req, (_, _, stop_tok_ids) in self.min_toks.items():
                reqs.extend([req] * len(stop_tok_ids))
                tok_ids.extend(stop_tok_ids)
            self.logits_slice = (torch.tensor(reqs, dtype=torch.int64, device=self.device),
                                 torch.tensor(tok_ids, dtype=torch.int64, device=self.device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits.index_put_(self.logits_slice, self.neg_inf_tensor)
        return logits


class CallCounter(LogitsProcessor):
    """Counts update_state calls: not a function of the output lists."""

    incremental_state = True

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.calls = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.calls += 1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class SpecAwareCallCounter(CallCounter):
    supports_spec_decode = True


class HoldsALock(LengthGateProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.lock = threading.Lock()

"""Processors written against vLLM's Model Runner V2 interface; only the imports differ from vLLM's.

# from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcessor, ...
"""

from __future__ import annotations

import numpy as np
import torch

from processors import SamplingParams
from processors.mrv2 import LogitsContext, LogitsProcessor, LogitsProcRequestState


class TargetTokenV2(LogitsProcessor):
    """``extra_args["target_token"]``: only that token may be sampled (the seed's Dummy, slot-keyed)."""

    def __init__(self, vllm_config, req_states: LogitsProcRequestState):
        self.targets_np = np.full(req_states.max_num_reqs, -1, dtype=np.int64)
        self.targets = torch.full((req_states.max_num_reqs,), -1, dtype=torch.int64, device=req_states.device)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"target_token must be a non-negative integer, got {target!r}")

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        target = (sampling_params.extra_args or {}).get("target_token")
        self.targets_np[req_idx] = -1 if target is None else target
        return target is not None

    def apply_staged_writes(self) -> None:
        self.targets.copy_(torch.from_numpy(self.targets_np))

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        targets = self.targets[ctx.expanded_idx_mapping]
        rows = torch.nonzero(targets >= 0).squeeze(1)
        if rows.numel():
            kept = logits[rows, targets[rows]].clone()
            logits[rows] = float("-inf")
            logits[rows, targets[rows]] = kept
        return logits


class BanUntilV2(LogitsProcessor):
    """``extra_args["ban_until"] = [token, n]``: ``token`` is banned while the output (committed
    tokens plus this row's drafts) is shorter than ``n``."""

    def __init__(self, vllm_config, req_states: LogitsProcRequestState):
        self.req_states = req_states
        self.rule = np.full((req_states.max_num_reqs, 2), -1, dtype=np.int64)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        rule = (sampling_params.extra_args or {}).get("ban_until")
        self.rule[req_idx] = (-1, -1) if rule is None else rule
        return rule is not None

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        slots = ctx.expanded_idx_mapping.cpu().numpy()
        output_len = self.req_states.total_len.np[slots] - self.req_states.prompt_len.np[slots]
        length = output_len + ctx.expanded_local_pos.cpu().numpy()
        token, until = self.rule[slots, 0], self.rule[slots, 1]
        rows = np.flatnonzero((token >= 0) & (length < until))
        if rows.size:
            logits[torch.from_numpy(rows), torch.from_numpy(token[rows])] = float("-inf")
        return logits


class BadWordsV2(LogitsProcessor):
    """vLLM's MRv2 bad-words stage, its Triton kernel's logic in torch: committed output from
    ``all_token_ids``, this step's drafts from the ``input_ids`` of the request's earlier rows.
    Words come as token ids in ``extra_args["bad_token_words"]``."""

    def __init__(self, vllm_config, req_states: LogitsProcRequestState):
        self.req_states = req_states
        self.words: dict[int, list[list[int]]] = {}

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        words = (sampling_params.extra_args or {}).get("bad_token_words")
        self.words[req_idx] = [list(w) for w in words or []]
        return bool(words)

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        state = self.req_states
        slots = ctx.expanded_idx_mapping.tolist()
        local = ctx.expanded_local_pos.tolist()
        input_ids = ctx.input_ids.tolist()
        for token_idx, (slot, pos) in enumerate(zip(slots, local)):
            prompt_len, total_len = int(state.prompt_len.np[slot]), int(state.total_len.np[slot])
            output_len = total_len - prompt_len
            effective_len = output_len + pos
            first = token_idx - pos
            for word in self.words.get(slot, []):
                prefix = word[:-1]
                if len(prefix) > effective_len:
                    continue
                actual = []
                for i in range(len(prefix)):
                    at = effective_len - len(prefix) + i
                    if at >= output_len:  # a draft of this step: the input of a later row of the request
                        actual.append(input_ids[first + (at - output_len) + 1])
                    else:
                        actual.append(int(state.all_token_ids.np[slot, prompt_len + at]))
                if actual == prefix:
                    logits[token_idx, word[-1]] = float("-inf")
        return logits


class NeverEnabled(LogitsProcessor):
    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return False

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        raise AssertionError("apply() must be skipped when no request enabled the processor")


class Recorder(LogitsProcessor):
    contexts: list[LogitsContext] = []

    def __init__(self, vllm_config, req_states: LogitsProcRequestState):
        self.req_states = req_states

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        Recorder.contexts.append(ctx)
        return logits

"""The three builtins vLLM implements with the programming model: min-p, logit bias, min tokens.

Each is vectorized over the batch, short-circuits when no row uses it, keeps
only live rows' state, and implements raysample's ``apply_rows`` (shard
logits) and ``state_digest`` (replica audit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from processors.digest import dict_items_sorted, digest_of
from processors.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
from processors.row_columns import apply_on_rows, upload
from processors.sampling_params import SamplingParams
from processors.state import process_dict_updates


def _to_device(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    return cpu if device.type == "cpu" else cpu.to(device, non_blocking=True)


def _shard_select(
    row_index: torch.Tensor, rows: slice, *others: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Keep the entries whose row lies in ``rows``, with rows made shard-relative."""
    keep = (row_index >= rows.start) & (row_index < rows.stop)
    return (row_index[keep] - rows.start, *(t[keep] for t in others))


class MinPLogitsProcessor(LogitsProcessor):
    """Drops tokens whose probability is below ``min_p`` times the row's top probability."""

    supports_spec_decode = True  # its state does not depend on the output lists: drafts change nothing

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.device = torch.device(device)
        self.min_p_count = 0  # rows with min-p on
        self.min_p_cpu = np.zeros((max_num_reqs,), dtype=np.float32)
        self.batch_size = 0

    def is_argmax_invariant(self) -> bool:
        return True

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if not 0.0 <= sampling_params.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {sampling_params.min_p}.")

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        cpu = self.min_p_cpu
        for index, params, _, _ in batch_update.added:
            new, old = params.min_p, cpu[index]
            if new != old:
                cpu[index] = new
                if new and not old:
                    self.min_p_count += 1
                elif old and not new:
                    self.min_p_count -= 1
        if self.min_p_count:
            for index in batch_update.removed:
                if cpu[index]:
                    cpu[index] = 0
                    self.min_p_count -= 1
            for a, b, direction in batch_update.moved:
                val_a, val_b = cpu[a], cpu[b]
                cpu[b] = val_a
                if direction == MoveDirectionality.SWAP:
                    cpu[a] = val_b
                else:
                    cpu[a] = 0
                    if val_b:  # the overwritten request had min-p on
                        self.min_p_count -= 1
        self.batch_size = batch_update.batch_size

    def _mask(self, logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p): no softmax needed.
        threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
        return logits.masked_fill_(logits < threshold, float("-inf"))

    def _apply_span(self, logits: torch.Tensor, start: int) -> torch.Tensor:
        stop = start + logits.shape[0]
        active = np.flatnonzero(self.min_p_cpu[start:stop])

        def mask(sub: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
            min_p = upload(self.min_p_cpu[idx + start], sub.device).unsqueeze(1)
            return self._mask(sub, min_p)

        return apply_on_rows(logits, active, mask)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.min_p_count:
            return logits
        return self._apply_span(logits, 0)

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        if not self.min_p_count:
            return logits
        return self._apply_span(logits, rows.start)

    def state_digest(self) -> bytes:
        return digest_of("min_p", self.batch_size, self.min_p_count, self.min_p_cpu[: self.batch_size].copy())


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds ``SamplingParams.logit_bias`` to the given tokens of each row."""

    supports_spec_decode = True  # its state does not depend on the output lists: drafts change nothing

    def __init__(self, _: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory
        self.biases: dict[int, dict[int, float]] = {}
        self._set_tensors([], [], [])

    def is_argmax_invariant(self) -> bool:
        return False

    def _set_tensors(self, reqs: list[int], toks: list[int], vals: list[float]) -> None:
        self.req_index = _to_device(torch.tensor(reqs, dtype=torch.long), self.device)
        self.tok_index = _to_device(torch.tensor(toks, dtype=torch.long), self.device)
        self.bias_tensor = _to_device(torch.tensor(vals, dtype=torch.float32), self.device)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.biases, batch_update, lambda params, _, __: params.logit_bias or None):
            reqs: list[int] = []
            toks: list[int] = []
            vals: list[float] = []
            for req, bias in self.biases.items():
                reqs.extend([req] * len(bias))
                toks.extend(bias.keys())
                vals.extend(bias.values())
            self._set_tensors(reqs, toks, vals)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.biases:
            logits.index_put_((self.req_index, self.tok_index), self.bias_tensor, accumulate=True)
        return logits

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        if self.biases:
            req, tok, val = _shard_select(self.req_index, rows, self.tok_index, self.bias_tensor)
            if req.numel():
                logits.index_put_((req, tok), val, accumulate=True)
        return logits

    def state_digest(self) -> bytes:
        return digest_of("logit_bias", [(i, sorted(b.items())) for i, b in dict_items_sorted(self.biases)])


class MinTokensLogitsProcessor(LogitsProcessor):
    """Masks every stop token (EOS included) until a request has ``min_tokens`` outputs."""

    supports_spec_decode = True  # reads live output lengths in apply: exact at every draft position

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory
        # row -> (min_tokens, live output list, stop token ids)
        self.min_toks: dict[int, tuple[int, Sequence[int], set[int]]] = {}
        self._set_tensors([], [])
        self.neg_inf_tensor = torch.tensor(-float("inf"), dtype=torch.float32, device=self.device)

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def add_request(
        params: SamplingParams, _: list[int] | None, output_tok_ids: list[int]
    ) -> tuple[int, Sequence[int], set[int]] | None:
        min_tokens = params.min_tokens
        if not min_tokens or len(output_tok_ids) >= min_tokens:
            return None
        return min_tokens, output_tok_ids, params.all_stop_token_ids

    def _set_tensors(self, reqs: list[int], toks: list[int]) -> None:
        self.req_index = _to_device(torch.tensor(reqs, dtype=torch.long), self.device)
        self.tok_index = _to_device(torch.tensor(toks, dtype=torch.long), self.device)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        needs_update = process_dict_updates(self.min_toks, batch_update, self.add_request)
        if self.min_toks:
            done = [i for i, (n, out, _) in self.min_toks.items() if len(out) >= n]
            for index in done:
                del self.min_toks[index]
            needs_update = needs_update or bool(done)
        if needs_update:
            reqs: list[int] = []
            toks: list[int] = []
            for req, (_, _, stop_ids) in self.min_toks.items():
                reqs.extend([req] * len(stop_ids))
                toks.extend(stop_ids)
            self._set_tensors(reqs, toks)

    def _live_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows still short of min_tokens *now*: output lists may hold draft tokens."""
        if all(len(out) < n for n, out, _ in self.min_toks.values()):
            return self.req_index, self.tok_index
        reqs: list[int] = []
        toks: list[int] = []
        for req, (n, out, stop_ids) in self.min_toks.items():
            if len(out) < n:
                reqs.extend([req] * len(stop_ids))
                toks.extend(stop_ids)
        return (
            _to_device(torch.tensor(reqs, dtype=torch.long), self.device),
            _to_device(torch.tensor(toks, dtype=torch.long), self.device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits.index_put_(self._live_index(), self.neg_inf_tensor)
        return logits

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        if self.min_toks:
            req_index, tok_index = self._live_index()
            req, tok = _shard_select(req_index, rows, tok_index)
            if req.numel():
                logits.index_put_((req, tok), self.neg_inf_tensor)
        return logits

    def apply_with_spec_decode(self, logits: torch.Tensor, num_draft_tokens: Sequence[int]) -> torch.Tensor:
        """Spec-decode layout: request ``r`` owns ``num_draft_tokens[r]`` consecutive rows.

        Row ``j`` of a request is the position after ``j`` extra tokens, so the
        stop tokens stay masked on the first ``min_tokens - len(output)`` rows.
        """
        if not self.min_toks:
            return logits
        counts = np.asarray(num_draft_tokens, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        row_parts: list[np.ndarray] = []
        tok_parts: list[np.ndarray] = []
        for req, (min_tokens, out, stop_ids) in self.min_toks.items():
            if not stop_ids or req >= len(counts):
                continue
            n_mask = int(min(max(min_tokens - len(out), 0), counts[req]))
            if n_mask:
                rows = np.arange(offsets[req], offsets[req] + n_mask, dtype=np.int64)
                stops = np.fromiter(sorted(stop_ids), dtype=np.int64)
                row_parts.append(np.repeat(rows, len(stops)))
                tok_parts.append(np.tile(stops, n_mask))
        if row_parts:
            index = (
                _to_device(torch.from_numpy(np.concatenate(row_parts)), logits.device),
                _to_device(torch.from_numpy(np.concatenate(tok_parts)), logits.device),
            )
            logits.index_put_(index, self.neg_inf_tensor)
        return logits

    def state_digest(self) -> bytes:
        return digest_of(
            "min_tokens",
            [(i, n, len(out), sorted(stop)) for i, (n, out, stop) in dict_items_sorted(self.min_toks)],
        )


BUILTIN_LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
)

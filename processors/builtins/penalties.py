"""Repetition, frequency and presence penalties, touching only tokens that occurred.

vLLM builds (rows, vocab) count tensors; here each step gathers the unique
(row, token) pairs of the outputs (and prompts, for repetition) and edits
only those logits, so the cost follows the token count, not the vocabulary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from processors.digest import digest_of
from processors.interface import BatchUpdate
from processors.row_columns import RowColumns, upload
from processors.rowwise_processor import RowwiseLogitsProcessor
from processors.sampling_params import SamplingParams


class PenaltiesLogitsProcessor(RowwiseLogitsProcessor):
    """Repetition on prompt ∪ output (positive logits divided, negative multiplied),
    then ``frequency * count`` and ``presence`` subtracted for output tokens."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.rows = RowColumns(
            vllm_config.scheduler_config.max_num_seqs,
            {
                "repetition": (np.float32, 1.0),
                "frequency": (np.float32, 0.0),
                "presence": (np.float32, 0.0),
                "prompt_tokens": (object, None),  # unique prompt ids (np.int64), rows with repetition only
                "output": (object, None),  # live output list
            },
        )
        self.num_active = 0

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _values(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> dict[str, Any] | None:
        if params.repetition_penalty == 1.0 and not params.frequency_penalty and not params.presence_penalty:
            return None
        return {
            "repetition": params.repetition_penalty,
            "frequency": params.frequency_penalty,
            "presence": params.presence_penalty,
            "prompt_tokens": np.unique(np.asarray(prompt or [], dtype=np.int64))
            if params.repetition_penalty != 1.0
            else None,
            "output": output,
        }

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if self.rows.update(batch_update, self._values):
            self.num_active = int(np.count_nonzero(self.rows["output"][: self.rows.batch_size] != None))  # noqa: E711

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        if not self.num_active:
            return logits
        outputs = self.rows["output"]
        active = [i for i in range(rows.start, rows.stop) if outputs[i] is not None]
        if not active:
            return logits
        vocab = logits.shape[1]
        local = np.asarray(active, dtype=np.int64) - rows.start
        out_lists = [outputs[i] for i in active]
        lengths = np.fromiter((len(o) for o in out_lists), dtype=np.int64, count=len(active))
        out_keys = np.repeat(local, lengths) * vocab + np.fromiter(
            (t for o in out_lists for t in o), dtype=np.int64, count=int(lengths.sum())
        )
        out_keys, out_counts = np.unique(out_keys, return_counts=True)

        rep = self.rows["repetition"]
        rep_rows = [(i, k) for i, k in zip(active, local) if rep[i] != 1.0]
        if rep_rows:
            prompt_keys = [self.rows["prompt_tokens"][i] + k * vocab for i, k in rep_rows]
            rep_local = np.asarray([k for _, k in rep_rows], dtype=np.int64)
            out_rep = out_keys[np.isin(out_keys // vocab, rep_local)]
            keys = np.union1d(np.concatenate(prompt_keys), out_rep)
            r, t = self._index(keys, vocab, logits.device)
            values = logits[r, t]
            penalty = upload(rep[keys // vocab + rows.start], logits.device)
            logits[r, t] = torch.where(values > 0, values / penalty, values * penalty)

        freq, pres = self.rows["frequency"], self.rows["presence"]
        if out_keys.size and (freq[active].any() or pres[active].any()):
            r, t = self._index(out_keys, vocab, logits.device)
            absolute = (out_keys // vocab) + rows.start
            f = upload(freq[absolute], logits.device)
            p = upload(pres[absolute], logits.device)
            counts = upload(out_counts.astype(np.float32), logits.device)
            logits[r, t] = logits[r, t] - f * counts - p
        return logits

    @staticmethod
    def _index(keys: np.ndarray, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        keys_t = torch.from_numpy(keys)
        return (keys_t // vocab).to(device), (keys_t % vocab).to(device)

    def state_digest(self) -> bytes:
        n = self.rows.batch_size
        outputs = self.rows["output"][:n]
        prompts = self.rows["prompt_tokens"][:n]
        return digest_of(
            "penalties",
            self.rows["repetition"][:n].copy(),
            self.rows["frequency"][:n].copy(),
            self.rows["presence"][:n].copy(),
            [None if o is None else len(o) for o in outputs],
            [None if p is None else p.tolist() for p in prompts],
        )

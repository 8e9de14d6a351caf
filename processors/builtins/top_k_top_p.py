"""Top-k then top-p filtering without sorting the whole vocabulary.

Top-k needs only the k largest values. Top-p needs the smallest set of most
likely tokens whose mass reaches p; it looks at the top ``m`` candidates and
widens ``m`` (x4) only for rows whose top ``m`` do not reach p yet, so a full
sort happens only for the rare very flat row. Cut-offs are thresholds on
values, so tied tokens are kept together and the result does not depend on
sort order or on which other rows are in the batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from processors.digest import digest_of
from processors.interface import BatchUpdate
from processors.row_columns import RowColumns, apply_on_rows, upload
from processors.rowwise_processor import RowwiseLogitsProcessor

FIRST_TOP_P_CANDIDATES = 64


def top_k_threshold(logits: torch.Tensor, k: np.ndarray) -> torch.Tensor:
    """(rows, 1) value of each row's k-th largest logit; -inf where k == 0 (off)."""
    k_max = int(k.max())
    top = logits.topk(k_max, dim=-1, sorted=True).values
    kth = top.gather(1, torch.from_numpy(np.maximum(k, 1) - 1).to(logits.device).unsqueeze(1))
    off = torch.from_numpy(k == 0).to(logits.device).unsqueeze(1)
    return kth.masked_fill_(off, float("-inf"))


def top_p_threshold(logits: torch.Tensor, p: np.ndarray, first: int = FIRST_TOP_P_CANDIDATES,
                    first_values: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, 1) smallest logit kept by top-p: tokens are kept while the mass of the
    tokens ranked above them is below p (so at least the top token survives).
    ``first_values``: each row's ``first`` largest logits, descending, where the caller has them."""
    rows, vocab = logits.shape
    device = logits.device
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    p_t = torch.from_numpy(p.astype(np.float32)).to(device).unsqueeze(1)
    thresholds = torch.empty(rows, 1, dtype=logits.dtype, device=device)
    pending = torch.arange(rows, device=device)
    m = min(vocab, first)
    while pending.numel():
        if first_values is not None and m == min(vocab, first):
            values = first_values  # (rows, m), descending: every row is pending in the first round
        else:
            sub = logits if pending.numel() == rows else logits.index_select(0, pending)
            values = sub.topk(m, dim=-1, sorted=True).values  # (pending, m), descending
        probs = (values - log_norm[pending]).exp_()
        mass_above = probs.cumsum(dim=-1) - probs  # mass of strictly higher-ranked tokens
        kept = (mass_above < p_t[pending]).sum(dim=-1, keepdim=True)  # >= 1
        reached = (mass_above[:, -1:] + probs[:, -1:]) >= p_t[pending]
        exhausted = values[:, -1:] == float("-inf")
        done = (reached | exhausted).squeeze(1) | (m == vocab)
        thresholds[pending[done]] = values[done].gather(1, kept[done] - 1)
        pending = pending[~done]
        m = min(vocab, m * 4)
    return thresholds


def _nucleus_in_window(values: torch.Tensor, p: np.ndarray) -> torch.Tensor:
    """(rows, 1) top-p threshold when ``values`` (descending) hold every kept token."""
    probs = (values - torch.logsumexp(values, dim=-1, keepdim=True)).exp_()
    mass_above = probs.cumsum(dim=-1) - probs
    kept = (mass_above < torch.from_numpy(p.astype(np.float32)).to(values.device).unsqueeze(1)).sum(dim=-1, keepdim=True)
    return values.gather(1, kept - 1)


def sorted_thresholds(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(rows, 1) cut-off of each row after top-k (``k`` 0: off) then top-p (``p`` 1: off), from one sort of
    the rows, with no value read on the host: the same rule as the windowed path (thresholds on values,
    ties kept together; the top-p mass is over the tokens top-k kept), for a device, where a sort of the
    vocabulary is cheap and a host read stalls the step. ``k``, ``p``: (rows,) on the logits' device."""
    vocab = logits.shape[1]
    values = logits.sort(dim=-1, descending=True).values  # (rows, vocab)
    index = (k.clamp(1, vocab) - 1).unsqueeze(1)
    kth = values.gather(1, index).masked_fill_((k == 0).unsqueeze(1), float("-inf"))
    kept_k = values.masked_fill(values < kth, float("-inf"))
    log_norm = torch.logsumexp(kept_k, dim=-1, keepdim=True)
    probs = (kept_k - log_norm).exp_()
    mass_above = probs.cumsum(dim=-1) - probs  # mass of strictly higher-ranked tokens
    kept = (mass_above < p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    nucleus = kept_k.gather(1, kept - 1).masked_fill_((p >= 1.0).unsqueeze(1), float("-inf"))
    return torch.maximum(kth, nucleus)


class TopKTopPLogitsProcessor(RowwiseLogitsProcessor):
    """Keeps each row's top-k tokens (ties kept), then its top-p nucleus of those.

    ``sync_free`` (on a device; the sampler sets it): one sort per row and no host read
    (``sorted_thresholds``); else, on CPU, the windowed search above, which avoids sorting the vocabulary."""

    sync_free = False

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows = RowColumns(
            vllm_config.scheduler_config.max_num_seqs, {"top_k": (np.int64, 0), "top_p": (np.float32, 1.0)}
        )
        self.device = torch.device(device)

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def values(params, _, __):
            if params.top_k <= 0 and params.top_p >= 1.0:
                return None
            return {"top_k": max(params.top_k, 0), "top_p": params.top_p}

        self.rows.update(batch_update, values)

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        k = np.minimum(self.rows["top_k"][rows.start : rows.stop], logits.shape[1])
        p = self.rows["top_p"][rows.start : rows.stop]
        local = np.flatnonzero((k > 0) | (p < 1.0))
        if self.sync_free:
            return self._filter_sorted(logits, local, k, p)
        return apply_on_rows(logits, local, lambda sub, idx: self._filter(sub, k[idx], p[idx]))

    @staticmethod
    def _filter_sorted(logits: torch.Tensor, local: np.ndarray, k: np.ndarray, p: np.ndarray) -> torch.Tensor:
        if not local.size:
            return logits
        device = logits.device
        every = local.size == logits.shape[0]
        sub = logits if every else logits.index_select(0, upload(local, device))
        threshold = sorted_thresholds(sub, upload(k[local], device), upload(p[local], device))
        if every:
            return logits.masked_fill_(logits < threshold, float("-inf"))
        index = upload(local, device)
        logits.index_copy_(0, index, sub.masked_fill_(sub < threshold, float("-inf")))
        return logits

    @staticmethod
    def _filter(logits: torch.Tensor, k: np.ndarray, p: np.ndarray) -> torch.Tensor:
        vocab = logits.shape[1]
        device = logits.device
        nucleus = p < 1.0
        window = int(min(vocab, max(int(k.max()), FIRST_TOP_P_CANDIDATES if nucleus.any() else 1)))
        values = logits.topk(window, dim=-1, sorted=True).values  # (rows, window), descending
        has_k = torch.from_numpy(k > 0).to(device).unsqueeze(1)
        kth = values.gather(1, torch.from_numpy(np.maximum(k, 1) - 1).to(device).unsqueeze(1))
        threshold = kth.masked_fill(~has_k, float("-inf"))  # (rows, 1)
        if nucleus.any():
            # A top-k set that fits in the window (no tie spilling past it) has its
            # whole mass there: no pass over the vocabulary is needed.
            fits = has_k & ((values[:, -1:] < kth) | (window == vocab))
            in_window = np.flatnonzero(nucleus & fits.squeeze(1).cpu().numpy())
            outside = np.flatnonzero(nucleus & ~fits.squeeze(1).cpu().numpy())
            if in_window.size:
                idx = torch.from_numpy(in_window).to(device)
                kept = values[idx].masked_fill(values[idx] < kth[idx], float("-inf"))
                threshold[idx] = torch.maximum(threshold[idx], _nucleus_in_window(kept, p[in_window]))
            if outside.size == len(k) and not (k > 0).any():
                # Top-p alone on every row: nothing is cut before it, and the window holds the
                # candidates its first round looks at (the same values, so the same threshold).
                threshold = top_p_threshold(logits, p, first=window, first_values=values)
            elif outside.size:
                idx = torch.from_numpy(outside).to(device)
                sub = logits[idx].masked_fill_(logits[idx] < threshold[idx], float("-inf"))
                threshold[idx] = torch.maximum(threshold[idx], top_p_threshold(sub, p[outside]))
        return logits.masked_fill_(logits < threshold, float("-inf"))

    def state_digest(self) -> bytes:
        n = self.rows.batch_size
        return digest_of("top_k_top_p", self.rows["top_k"][:n].copy(), self.rows["top_p"][:n].copy())

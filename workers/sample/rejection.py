"""Verifying n-gram drafts: every stage per draft position, then rejection sampling.

Position ``j`` of a row is processed with its drafts ``d1..dj`` appended to
the row's output list and ``update_state(None)`` called since, so every
processor that reads output ids (penalties, bad words, min tokens, custom
ones, the thinking budget) sees exactly what it would see without
speculation. Afterwards the drafts are removed and each processor is put back
as it was before them (``Sampler.draft_restore``).

Every row samples position ``j`` exactly as it would without speculation:
greedy rows take the argmax, random rows the counter-based sample keyed by
(request key, position). A draft is accepted while it equals that token; the
first mismatch emits the token, and a row that accepts all its drafts emits
the bonus token. For one-hot (n-gram) drafts this is rejection sampling:
draft ``d`` is accepted with probability ``p(d)``, and a rejection emits a
sample of ``p`` conditioned on not ``d``, the residual distribution. Because
the token at each position does not depend on whether a draft was proposed
there, output with speculation equals output without it token for token, for
random rows as for greedy ones, whatever the scheduling (preemption, budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from workers.sample.sampler import Sampler
from workers.sample.sampler_errors import row_errors
from workers.wire import TokenLogprobs


@dataclass
class DraftVerification:
    tokens: list[list[int]]  # per shard row: 1..k+1 emitted tokens
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    # Rows that could not be sampled at some position (``SamplerOutput.errors``), by batch row; their
    # tokens are a placeholder [0].
    errors: dict[int, str] = field(default_factory=dict)
    model_faults: list[int] = field(default_factory=list)  # of those, the model's (``SamplerOutput.model_faults``)

    def accepted_drafts(self, row: int) -> int:
        return len(self.tokens[row]) - 1


def verify_drafts(sampler: Sampler, logits: torch.Tensor, rows: slice, drafts: list[list[int]]) -> DraftVerification:
    """``logits``: for each shard row ``i``, ``len(drafts[rows.start + i]) + 1`` consecutive rows.

    ``drafts`` covers the whole batch: every replica appends every row's drafts.
    """
    n = rows.stop - rows.start
    shard_drafts = drafts[rows.start : rows.stop]
    counts = np.array([len(d) for d in shard_drafts], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    if logits.shape[0] != int((counts + 1).sum()):
        raise ValueError(f"expected {int((counts + 1).sum())} logits rows for the drafts, got {logits.shape[0]}")
    outputs = sampler.rows["output"]
    greedy = sampler.rows["greedy"][rows.start : rows.stop]
    logprob_local = set(sampler.logprob_rows(rows).tolist())
    emitted: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprobs] | None] = [[] if i in logprob_local else None for i in range(n)]
    done = np.zeros(n, dtype=bool)
    errors: dict[int, str] = {}
    model_faults: list[int] = []
    appended = [0] * sampler.batch_size
    snapshots = sampler.draft_snapshot() if any(drafts) else []
    try:
        for j in range(int(counts.max(initial=0)) + 1):
            if j > 0:
                for r, row_drafts in enumerate(drafts):
                    if j - 1 < len(row_drafts):
                        outputs[r].append(row_drafts[j - 1])
                        appended[r] += 1
                sampler.drafts_appended()
            active = np.flatnonzero(~done & (j <= counts))
            if active.size == 0:
                break
            # Rows without position j get one of their own rows as filler; their results are ignored.
            index = torch.from_numpy(offsets + np.minimum(j, counts)).to(logits.device)
            step_logits = logits.index_select(0, index)
            raw = step_logits.clone() if logprob_local else None
            tracker = sampler.tracker()
            processed, chosen, row_max = sampler.process(step_logits, rows,
                                                         {r: c for r, c in enumerate(appended) if c}, tracker)
            tokens = _with_random_rows(sampler, processed, chosen, row_max, active[~greedy[active]], rows)
            is_active = torch.zeros(n, dtype=torch.bool, device=row_max.device)
            is_active[torch.from_numpy(active).to(row_max.device)] = True
            bad_here = row_errors(row_max, rows, tracker, only=is_active, model_faults=model_faults)
            if bad_here:
                for row, message in bad_here.items():
                    errors.setdefault(row, message)
                    done[row - rows.start] = True
                active = active[~done[active]]
            finished_here = np.zeros(n, dtype=bool)
            has_draft = active[counts[active] > j]
            if has_draft.size:
                draft_tok = np.array([shard_drafts[i][j] for i in has_draft], dtype=np.int64)
                match = tokens[torch.from_numpy(has_draft)].cpu().numpy() == draft_tok
                finished_here[has_draft[~match]] = True
            finished_here[active[counts[active] == j]] = True  # the bonus position
            token_list = tokens.tolist()
            if raw is not None:
                asked = np.array([i for i in active if i in logprob_local], dtype=np.int64)
                if asked.size:
                    entries = sampler.logprobs(raw[torch.from_numpy(asked)], asked, rows, tokens)
                    for i in asked:
                        lps[i].append(entries[int(i) + rows.start])
            for i in active:
                emitted[i].append(token_list[i])
            done |= finished_here
    finally:
        for r, count in enumerate(appended):
            if count:
                del outputs[r][-count:]
        if any(appended):
            sampler.draft_restore(snapshots)
    for row in errors:  # placeholders: the request fails, these tokens are never used
        emitted[row - rows.start], lps[row - rows.start] = [0], None
    return DraftVerification(tokens=emitted, logprobs=lps, errors=errors, model_faults=model_faults)


def _with_random_rows(sampler: Sampler, processed: torch.Tensor, chosen: torch.Tensor, row_max: torch.Tensor,
                      random_rows: np.ndarray, rows: slice) -> torch.Tensor:
    """The position's tokens: the greedy ``chosen`` with ``random_rows`` sampled from ``processed`` (their maxima
    into ``row_max``, a row bad at the greedy point staying bad)."""
    tokens = chosen.clone()
    if random_rows.size:
        index = torch.from_numpy(random_rows).to(tokens.device)
        sub = processed.index_select(0, torch.from_numpy(random_rows).to(processed.device))
        random_max = torch.empty(random_rows.size, dtype=sub.dtype, device=sub.device)
        tokens[index] = sampler.sample_rows(sub, random_rows + rows.start, row_max=random_max).to(tokens.device)
        before = row_max[index]
        row_max[index] = torch.where(torch.isfinite(before), random_max.to(row_max.dtype), before)
    return tokens

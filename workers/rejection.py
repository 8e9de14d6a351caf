"""Verifying n-gram drafts: every stage per draft position, then rejection sampling.

Position ``j`` of a row is processed with its drafts ``d1..dj`` appended to
the row's output list (and removed afterwards), so every processor that
reads output ids (penalties, bad words, min tokens, custom ones, the
thinking budget) sees exactly what it would see without speculation.

Greedy rows accept while the draft equals the argmax; the first mismatch
emits the argmax, and a row that accepts all its drafts emits the bonus
token. Random rows accept draft ``d`` with probability ``p(d)`` (n-gram
drafts are one-hot proposals); on rejection they sample from ``p`` with
``d`` removed, which makes every emitted token distributed exactly as
without speculation. All randomness comes from the counter-based generator
(independent streams by salt), so results do not depend on placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from workers.counter_rng import uniform
from workers.sampler import Sampler, TokenLogprobs

SALT_ACCEPT = 1
SALT_RESAMPLE = 2


@dataclass
class DraftVerification:
    tokens: list[list[int]]  # per shard row: 1..k+1 emitted tokens
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)

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
    appended = [0] * sampler.batch_size
    try:
        for j in range(int(counts.max(initial=0)) + 1):
            if j > 0:
                for r, row_drafts in enumerate(drafts):
                    if j - 1 < len(row_drafts):
                        outputs[r].append(row_drafts[j - 1])
                        appended[r] += 1
            active = np.flatnonzero(~done & (j <= counts))
            if active.size == 0:
                break
            # Rows without position j get one of their own rows as filler; their results are ignored.
            index = torch.from_numpy(offsets + np.minimum(j, counts)).to(logits.device)
            step_logits = logits.index_select(0, index)
            raw = step_logits.clone() if logprob_local else None
            processed, chosen = sampler.process(step_logits, rows, {r: c for r, c in enumerate(appended) if c})
            tokens = chosen.clone()
            finished_here = np.zeros(n, dtype=bool)
            has_draft = active[counts[active] > j]
            draft_tok = np.array([shard_drafts[i][j] for i in has_draft], dtype=np.int64)
            # Greedy rows: accept while the draft is the argmax.
            g = ~greedy[has_draft] if has_draft.size else np.zeros(0, dtype=bool)
            greedy_rows, greedy_drafts = has_draft[~g], draft_tok[~g]
            if greedy_rows.size:
                match = chosen[torch.from_numpy(greedy_rows)].cpu().numpy() == greedy_drafts
                finished_here[greedy_rows[~match]] = True
            random_rows, random_drafts = has_draft[g], draft_tok[g]
            if random_rows.size:
                rejected = _reject(sampler, processed, random_rows, random_drafts, rows)
                accepted_rows = random_rows[~rejected]
                tokens[torch.from_numpy(accepted_rows)] = torch.from_numpy(random_drafts[~rejected]).to(tokens.device)
                if rejected.any():
                    bad_rows, bad_drafts = random_rows[rejected], random_drafts[rejected]
                    sub = processed.index_select(0, torch.from_numpy(bad_rows).to(processed.device))
                    sub[torch.arange(bad_rows.size), torch.from_numpy(bad_drafts)] = float("-inf")
                    tokens[torch.from_numpy(bad_rows)] = sampler.sample_rows(sub, bad_rows + rows.start, SALT_RESAMPLE)
                    finished_here[bad_rows] = True
            # Bonus position (all drafts accepted): an ordinary sample.
            bonus = active[counts[active] == j]
            bonus_random = bonus[~greedy[bonus]]
            if bonus_random.size:
                sub = processed.index_select(0, torch.from_numpy(bonus_random).to(processed.device))
                tokens[torch.from_numpy(bonus_random)] = sampler.sample_rows(sub, bonus_random + rows.start)
            finished_here[bonus] = True
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
    return DraftVerification(tokens=emitted, logprobs=lps)


def _reject(sampler: Sampler, processed: torch.Tensor, local: np.ndarray, drafts: np.ndarray, rows: slice) -> np.ndarray:
    """True where draft ``d`` is rejected: u >= p(d), with u from the accept stream."""
    index = torch.from_numpy(local).to(processed.device)
    sub = processed.index_select(0, index)
    log_p = sub.gather(1, torch.from_numpy(drafts).to(sub.device).unsqueeze(1)).squeeze(1) - torch.logsumexp(sub, dim=-1)
    base = sampler.random_base(local + rows.start, SALT_ACCEPT).to(processed.device)
    u = uniform(base, torch.from_numpy(drafts).to(processed.device))
    return (u >= log_p.exp()).cpu().numpy()

"""How many n-gram drafts each row verifies in a step: from its acceptance history and the load.

A draft costs a sampled position of forward work (its token through every layer, its row of
the LM head and the sampler) whether or not it is accepted; it pays only with the probability
that it and every draft before it are accepted. So the step is planned to maximise expected
tokens per second of step time: drafts are taken in order of their expected gain while that
gain beats the step's current tokens-per-cost. With few rows a step costs mostly its fixed part
and drafts are nearly free; with a full batch on a compute-bound device a position costs as much
as the tokens it might win, and only rows whose drafts are almost always accepted keep them. The draft counts change what a step computes, never what it samples: spec
decode is exact whatever is verified.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PRIOR_WEIGHT = 2.0  # pseudo-trials of the batch-wide acceptance behind each row's own
HISTORY_DECAY = 0.8  # weight of a row's earlier evidence at each new observation
# A draft must beat the break-even gain by this factor: verification has costs the linear model
# does not see (a second attention group per layer, the rejection sampler), and a draft that only
# breaks even is not worth the risk of being slower than no speculation.
MARGIN = 1.25


@dataclass
class StepCostModel:
    """Step seconds ~ ``fixed + per_position * sampled positions``, least squares over recent steps.

    Fed only steps without prompt tokens, where every position fed is sampled (a decode token or
    a draft): a draft is priced at what a sampled position costs, not at a prompt token's much
    lower share of a large batched product. Weights decay by ``decay`` per step, so the fit follows
    the load; while recent steps all sampled about the same number of positions the slope is not
    identified and the last good fit stands.
    """

    decay: float = 0.98
    min_weight: float = 8.0
    min_spread: float = 2.0  # standard deviation of positions, below which the slope is not trusted
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, n, t, n*n, n*t
    _fit: tuple[float, float] | None = None

    def observe(self, positions: int, seconds: float) -> None:
        if positions <= 0 or seconds <= 0:
            return
        if self._fit is not None:  # a pause (GC, a noisy neighbour) is not what positions cost
            seconds = min(seconds, 2.0 * (self._fit[0] + self._fit[1] * positions))
        s = self._sums
        for i, value in enumerate((1.0, positions, seconds, positions * positions, positions * seconds)):
            s[i] = s[i] * self.decay + value
        w, n, t, nn, nt = s
        spread = w * nn - n * n  # w^2 times the variance of positions
        if w < self.min_weight or spread < (self.min_spread * w) ** 2:
            return
        per_position = max(0.0, (w * nt - n * t) / spread)
        fixed = max(0.0, (t - per_position * n) / w)
        if per_position > 0 or fixed > 0:
            self._fit = (fixed, per_position)

    @property
    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per sampled position), or None before the slope was identified."""
        return self._fit


@dataclass
class Acceptance:
    """Decayed counts of draft positions verified and accepted."""

    accepted: float = 0.0
    trials: float = 0.0

    def add(self, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` drafts taken: positions up to the first rejection were tried."""
        self.accepted = self.accepted * HISTORY_DECAY + accepted
        self.trials = self.trials * HISTORY_DECAY + min(proposed, accepted + 1)


class DraftPolicy:
    """Trims the drafter's proposals to the counts that are worth verifying this step."""

    def __init__(self) -> None:
        self.cost = StepCostModel()
        self.overall = Acceptance(accepted=1.0, trials=2.0)  # prior: one in two
        self.rows: dict[str, Acceptance] = {}

    def rate(self, request_id: str) -> float:
        """Estimated chance that a draft position is accepted given those before it were."""
        overall = self.overall.accepted / self.overall.trials
        own = self.rows.get(request_id)
        if own is None:
            return overall
        return (own.accepted + PRIOR_WEIGHT * overall) / (own.trials + PRIOR_WEIGHT)

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.rows.setdefault(request_id, Acceptance()).add(proposed, accepted)
        self.overall.accepted += accepted
        self.overall.trials += min(proposed, accepted + 1)

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def choose(self, proposals: Mapping[str, list[int]], sampling_rows: int) -> dict[str, list[int]]:
        """The prefix of each proposal to verify in a step that samples ``sampling_rows`` rows.

        The step's prompt tokens are left out of its cost, which only makes drafts look dearer."""
        fit = self.cost.fit
        if fit is None:  # no cost estimate yet: verify what the drafter found
            return {rid: drafts for rid, drafts in proposals.items() if drafts}
        fixed, per_token = fit
        gains = []
        for rid, drafts in proposals.items():
            rate, gain = self.rate(rid), 1.0
            for i in range(len(drafts)):
                gain *= rate
                gains.append((-gain, i, rid))
        gains.sort()
        tokens, cost = float(sampling_rows), fixed + per_token * sampling_rows
        taken: dict[str, int] = {}
        for negative_gain, i, rid in gains:
            gain = -negative_gain
            if gain * cost <= MARGIN * per_token * tokens:
                break  # taking a draft raises tokens per cost, so every smaller gain fails too
            if taken.get(rid, 0) != i:
                continue  # its row stopped at an earlier position
            taken[rid] = i + 1
            tokens += gain
            cost += per_token
        return {rid: proposals[rid][:count] for rid, count in taken.items()}

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
# does not see (the rejection sampler, the drafter), and a draft that only breaks even is not
# worth the risk of being slower than no speculation.
MARGIN = 1.25
# With nothing waiting, rows within this share of the most tokens left are on the critical path.
CRITICAL_SHARE = 0.9


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
class AcceptanceHistory:
    """Decayed counts of draft positions verified and accepted."""

    accepted: float = 0.0
    trials: float = 0.0

    def add(self, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` drafts taken: positions up to the first rejection were tried."""
        self.accepted = self.accepted * HISTORY_DECAY + accepted
        self.trials = self.trials * HISTORY_DECAY + min(proposed, accepted + 1)


class DraftPolicy:
    """Trims the drafter's proposals to the counts that are worth verifying this step.

    Two costs are priced: each sampled position (the cost model's slope), and each draft depth,
    since verification runs one sampling pass over the whole shard per draft position: one row
    with three drafts makes every row's sampler run four times.
    """

    def __init__(self) -> None:
        self.cost = StepCostModel()
        self.pass_s = 0.0  # seconds of one sampling pass over a shard, recent average
        self.overall = AcceptanceHistory(accepted=1.0, trials=2.0)  # prior: one in two
        self.rows: dict[str, AcceptanceHistory] = {}

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
        self.rows.setdefault(request_id, AcceptanceHistory()).add(proposed, accepted)
        self.overall.accepted += accepted
        self.overall.trials += min(proposed, accepted + 1)

    def observe_step(self, positions: int, depth: int, seconds: float, pass_s: float) -> None:
        """A step without prompt tokens: ``depth`` = most drafts of a row, ``pass_s`` = the slowest
        worker's sampling pass."""
        if pass_s > 0:
            self.pass_s = pass_s if self.pass_s == 0 else 0.9 * self.pass_s + 0.1 * pass_s
        self.cost.observe(positions, seconds - self.pass_s * depth)

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    @staticmethod
    def critical_rows(tokens_left: Mapping[str, int]) -> list[str]:
        """With no request waiting for a row, a row that finishes early frees a row nobody needs:
        only the rows with the most tokens left set how long the batch runs. Drafting then pays
        only if every one of them has drafts, and only theirs are worth verifying."""
        longest = max(tokens_left.values(), default=0)
        return [rid for rid, left in tokens_left.items() if left >= CRITICAL_SHARE * longest]

    def choose(self, proposals: Mapping[str, list[int]], sampling_rows: int) -> dict[str, list[int]]:
        """The prefix of each proposal to verify in a step that samples ``sampling_rows`` rows.

        Every draft depth is tried (each costs a sampling pass); within one, drafts are taken by
        expected gain while they raise tokens per cost. The step's prompt tokens are left out of
        its cost, which only makes drafts look dearer.
        """
        fit = self.cost.fit
        if fit is None:  # no cost estimate yet: verify what the drafter found
            return {rid: drafts for rid, drafts in proposals.items() if drafts}
        fixed, per_position = fit
        gains = []
        for rid, drafts in proposals.items():
            rate, gain = self.rate(rid), 1.0
            for i in range(len(drafts)):
                gain *= rate
                gains.append((-gain, i, rid))
        gains.sort()
        base_cost = fixed + per_position * sampling_rows
        best: tuple[float, dict[str, int]] = (sampling_rows / base_cost if base_cost > 0 else 0.0, {})
        for depth in range(1, max((len(d) for d in proposals.values()), default=0) + 1):
            tokens, cost = float(sampling_rows), base_cost + self.pass_s * depth
            taken: dict[str, int] = {}
            for negative_gain, i, rid in gains:
                gain = -negative_gain
                if gain * cost <= MARGIN * per_position * tokens:
                    break  # taking a draft raises tokens per cost, so every smaller gain fails too
                if i >= depth or taken.get(rid, 0) != i:
                    continue  # deeper than this step verifies, or its row stopped earlier
                taken[rid] = i + 1
                tokens += gain
                cost += per_position
            if taken and tokens / cost > best[0]:
                best = (tokens / cost, taken)
        return {rid: proposals[rid][:count] for rid, count in best[1].items()}

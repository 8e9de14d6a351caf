"""What crosses the coordinator/worker boundary each step: small typed messages, per-row data as arrays.

Both sides import this module (workers sit below the coordinator in the layers). A plan is
built once per step and serialized once for every worker; its size grows with the rows that
changed (added rows, new KV blocks, drafts), plus a few bytes per row for the step's tokens
and schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from processors import MoveDirectionality, SamplingParams

EMPTY = np.zeros(0, dtype=np.int32)


def offsets_of(counts: np.ndarray) -> np.ndarray:
    """Start of each row's run in a flat array of ``counts`` runs (one more entry: the total)."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out



@dataclass
class TokenLogprobs:
    """Logprobs of one sampled position, from the raw (unprocessed) logits."""

    top_token_ids: list[int]
    top_logprobs: list[float]
    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int  # 1 = most likely


@dataclass(frozen=True)
class AddedRow:
    """A request entering row ``index`` (index at the time of the add, as in BatchUpdate)."""

    index: int
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before (re-admission after a failure)
    owner: int


@dataclass(frozen=True)
class PlanUpdate:
    """A BatchUpdate with plain data instead of live lists; each worker rebuilds its own."""

    batch_size: int
    removed: list[int]
    added: list[AddedRow]
    moved: list[tuple[int, int, MoveDirectionality]]


@dataclass(frozen=True)
class StepPlan:
    """The same plan goes to every worker every step.

    Rows' work: feed tokens ``start[r] .. start[r] + num_tokens[r]`` of prompt + output (owner
    only); the row samples a real token when that reaches the end of what it has, otherwise it
    is a prefill chunk whose sample is discarded. ``block_rows[i]`` gets ``block_counts[i]`` new
    KV blocks, taken in order from ``block_ids`` (an added row starts with an empty table).
    """

    step: int
    # Tokens accepted last step, rows of the layout before this step's update: a flat array,
    # ``last_counts[r]`` of them for row r; ``last_counts is None``: one per row (or none at all
    # when ``last_tokens`` is empty).
    last_tokens: np.ndarray
    last_counts: np.ndarray | None
    update: PlanUpdate | None
    shards: np.ndarray  # (workers, 2): each worker's rows [start, stop) after the update, in worker order
    start: np.ndarray  # int64 per row after the update
    num_tokens: np.ndarray  # int32 per row
    block_rows: np.ndarray = field(default_factory=lambda: EMPTY)
    block_counts: np.ndarray = field(default_factory=lambda: EMPTY)
    block_ids: np.ndarray = field(default_factory=lambda: EMPTY)
    draft_tokens: np.ndarray | None = None  # speculative decoding only: flat, ``draft_counts[r]`` per row
    draft_counts: np.ndarray | None = None
    audit: bool = False  # return state digests this step

    @property
    def batch_size(self) -> int:
        return len(self.start)

    @cached_property
    def draft_offsets(self) -> np.ndarray:
        return offsets_of(self.draft_counts) if self.draft_counts is not None else EMPTY

    def drafts_of(self, row: int) -> list[int]:
        if self.draft_counts is None:
            return []
        offsets = self.draft_offsets
        return self.draft_tokens[offsets[row] : offsets[row + 1]].tolist()

    def new_blocks(self) -> dict[int, list[int]]:
        """Row -> the blocks it gains this step (rows that gain none are absent)."""
        ids = self.block_ids.tolist()
        out, at = {}, 0
        for row, count in zip(self.block_rows.tolist(), self.block_counts.tolist()):
            out[row] = ids[at : at + count]
            at += count
        return out


@dataclass
class StepTimings:
    """Where a worker's step went, for the engine's profile (``cluster.engine.step_profile``) and its stats."""

    compute_s: float = 0.0  # the step's wall seconds on the worker
    # Seconds applying the plan to the replicas (tokens, BatchUpdate, processors' update_state):
    # the part of a worker's host time that grows with the global batch, not its shard.
    plan_s: float = 0.0
    # Seconds of one sampling pass over the shard (verifying drafts takes one per draft position).
    sample_pass_s: float = 0.0
    # CPU seconds of the step on the worker's thread (host work; a GPU's or a simulated compute's
    # waiting is not in it), and the modelled compute slept by a simulated runner.
    cpu_s: float = 0.0
    simulated_s: float = 0.0
    # The pipelined step (``workers.step.ahead``): rows whose logits the forward launched at the end of
    # the last step computed, rows it computed that the plan did not keep, its modelled compute,
    # and the CPU seconds of applying this plan while it ran (off the step's critical path).
    ahead_rows: int = 0
    wasted_rows: int = 0
    ahead_s: float = 0.0
    overlap_cpu_s: float = 0.0
    # CPU seconds of the processors' update_state, run while the step's forward did (both steps).
    update_cpu_s: float = 0.0


@dataclass
class StepResult:
    worker_id: int
    step: int
    rows: tuple[int, int]
    # The sampled tokens of the shard's rows, flat: ``counts[i]`` for shard row i, or one each
    # when ``counts is None`` (no drafts verified).
    tokens: np.ndarray = field(default_factory=lambda: EMPTY)
    counts: np.ndarray | None = None
    # Logprobs of each sampled token, by batch row, for the rows that asked.
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # Rows whose request asks for prompt logprobs, by batch row: (the index of the first prompt token covered,
    # each covered token's logprob, rank and the top others), from the raw logits of the step's chunk.
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Rows that could not be sampled (NaN, +inf, every token masked), by batch row: why. Their
    # request fails; their tokens are placeholders.
    errors: dict[int, str] = field(default_factory=dict)
    # Of those, the rows the model's forward left NaN or +inf: the step asks the workers' self-check
    # before it blames their requests (the engine may be broken, not the requests).
    model_faults: list[int] = field(default_factory=list)
    # Audit: per-row mirror digests and per-processor digests.
    row_digests: list[bytes] | None = None
    processor_digests: dict[str, bytes] | None = None
    timings: StepTimings = field(default_factory=StepTimings)

    def token_lists(self) -> list[list[int]]:
        """Per shard row, its tokens (for tests and slow paths)."""
        tokens = self.tokens.tolist()
        if self.counts is None:
            return [[t] for t in tokens]
        offsets = offsets_of(self.counts).tolist()
        return [tokens[offsets[i] : offsets[i + 1]] for i in range(len(self.counts))]


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once its model and KV cache are up."""

    device: str
    num_blocks: int
    block_size: int
    # Per rank of the worker's tensor-parallel group (one entry when it has none): bytes of the
    # model's shard and of the KV cache that rank holds.
    weight_bytes: tuple[int, ...] = ()
    kv_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class TensorRank:
    """One rank's place in its worker's tensor-parallel group (``workers.model.tensor_parallel``)."""

    rank: int
    size: int
    address: str  # the group's rendezvous, tcp://host:port on the lead rank's node

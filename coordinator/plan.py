"""What crosses the coordinator/worker boundary each step: small typed dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from processors import MoveDirectionality, SamplingParams
from workers.sampler import TokenLogprobs


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
class RowSchedule:
    """One row's work: feed tokens ``start .. start + num_tokens`` of prompt + output (its owner only).

    ``new_blocks`` extend the row's block table (an added row starts with an empty one). The row
    samples a real token when the fed tokens reach the end of what it has; otherwise it is a
    prefill chunk and its sample is discarded.
    """

    start: int
    num_tokens: int
    new_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """The same plan goes to every worker every step."""

    step: int
    # Tokens accepted last step, per row of the layout before this step's update.
    last_tokens: list[list[int]]
    update: PlanUpdate | None
    # (start, stop) rows of each worker after the update; contiguous, in worker order.
    shards: list[tuple[int, int]]
    all_greedy: bool
    schedule: list[RowSchedule] = field(default_factory=list)  # per row after the update
    drafts: list[list[int]] | None = None  # per row, speculative decoding only
    audit: bool = False  # return state digests this step


@dataclass
class StepResult:
    worker_id: int
    step: int
    rows: tuple[int, int]
    # Per shard row: the sampled token(s).
    tokens: list[list[int]]
    # Per shard row: logprobs of each sampled token, or None when not asked.
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    # Audit: per-row mirror digests and per-processor digests.
    row_digests: list[bytes] | None = None
    processor_digests: dict[str, bytes] | None = None
    compute_s: float = 0.0
    # Seconds of one sampling pass over the shard (verifying drafts takes one per draft position).
    sample_pass_s: float = 0.0


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once its model and KV cache are up."""

    device: str
    num_blocks: int
    block_size: int

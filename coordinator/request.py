"""A request's life on the coordinator, and what callers get back (vLLM's output shape)."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any

from processors import SamplingParams
from workers.wire import TokenLogprobs

if TYPE_CHECKING:
    from coordinator.kv_blocks import KVState

_arrivals = itertools.count()


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # rejected at admission (invalid params, prompt too long, ...)


@dataclass
class Logprob:
    """One token's log probability in a position's logprobs, as vLLM's ``Logprob``.

    ``rank``: 1 for the most likely token; the sampled token, when it is not among the top ones,
    has its rank in the whole vocabulary. ``decoded_token``: the token alone, decoded.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs, as vLLM: the sampled token first, then the top ``logprobs`` tokens by rank.
PositionLogprobs = dict[int, Logprob]


def top_of(position: PositionLogprobs, sampled: int, num_top: int) -> list[tuple[int, Logprob]]:
    """The top ``num_top`` entries of a position by rank (-1: all), without a sampled token outside them."""
    entries = [(t, lp) for t, lp in position.items() if num_top < 0 or len(position) <= num_top or t != sampled]
    return sorted(entries, key=lambda e: e[1].rank or 0)


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request, as vLLM's ``CompletionOutput``.

    ``new_text`` / ``new_token_ids``: what this completion gained since the previous output (streaming).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A snapshot of one request, as vLLM's ``RequestOutput``: ``outputs`` holds its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    # vLLM's: None first, then each prompt token's {token: Logprob} (the token and the top prompt_logprobs
    # others), once the whole prompt has been computed; None without prompt_logprobs.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    lora_request: Any = None  # the LoRARequest it ran with (vLLM's field), None for the base model
    # The error came from the engine (no worker left, a step failure no request alone explains),
    # not from the request: running it again may succeed, so a resumed job retries it.
    retryable: bool = False
    # The request was refused when it was submitted (validation: a prompt too long, logprobs past the
    # limit, a processor's validate_params), before it ran: vLLM's LLM.generate raises ValueError for these.
    refused: bool = False
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None

    # The first completion's fields, for n == 1 code.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def new_text(self) -> str:
        return self.outputs[0].new_text

    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids


@dataclass
class RequestGroup:
    """The ``n`` sibling rows of one request: child 0 prefills the prompt, the others share its blocks."""

    request_id: str
    children: list[Request] = field(default_factory=list)
    owner: int | None = None  # child 0's worker when it scheduled its prompt
    prompt_ready: bool = False  # child 0's prompt blocks are (being) computed
    # Only the final output is wanted (``generate``, batch jobs): no output is built per step,
    # as vLLM's offline ``LLM.generate`` asks for FINAL_ONLY.
    final_only: bool = False

    # With prompt logprobs: each prompt position's, as the workers computed them (index 0 stays None: the
    # first token has no context); filled once however often a position is computed (chunks, recomputes).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def take_prompt_logprobs(self, first: int, positions: list[TokenLogprobs]) -> None:
        """Positions ``first``, ``first + 1``, ... of the prompt, from one worker's step."""
        known = self.prompt_logprobs
        if known is None:
            return
        for index, entry in enumerate(positions, start=first):
            if 0 < index < len(known) and known[index] is None:
                known[index] = entry


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    group: RequestGroup | None = None
    child_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = field(default_factory=lambda: next(_arrivals))
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    logprob_dicts: list[PositionLogprobs] = field(default_factory=list)  # vLLM's shape, built as outputs are
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    retryable: bool = False  # see RequestOutput.retryable
    refused: bool = False  # see RequestOutput.refused
    owner: int | None = None  # worker holding its row
    kv: KVState | None = None
    kv_owner: int | None = None  # worker whose blocks ``kv`` names
    slot: int | None = None  # its slot in the scheduler's SlotTable while it holds a row
    num_preemptions: int = 0
    grammar: Future | None = None  # compiling its structured-output constraint
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def cache_salt(self, prefix_caching: bool) -> bytes | None:
        """Namespace of its blocks in the prefix index: global, its siblings only, or none. A request that
        asks for prompt logprobs computes its whole prompt (as vLLM: a cached prefix has no logits)."""
        lora = self.params._lora
        if prefix_caching and self.params.prompt_logprobs is None:
            # A LoRA adapter changes every layer's K/V: its requests share cached blocks with its own only.
            return b"" if lora is None else f"lora:{lora.lora_int_id}:".encode()
        if self.params.prompt_logprobs is not None and self.group is not None:
            return b"group:" + self.group.request_id.encode()
        if self.group is not None and len(self.group.children) > 1:
            return b"group:" + self.group.request_id.encode()
        return None

    @property
    def pinned_owner(self) -> int | None:
        """Siblings run where child 0 computed the prompt, to share its blocks."""
        return self.group.owner if self.group is not None and self.child_index > 0 else None

    def constraint_ready(self) -> bool:
        return self.grammar is None or self.grammar.done()

    def admissible(self) -> bool:
        return self.child_index == 0 or self.group is None or self.group.prompt_ready

    def preempt(self) -> None:
        self.status = RequestStatus.WAITING
        self.num_preemptions += 1

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None,
               retryable: bool = False) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.retryable = retryable
        self.finished_time = time.monotonic()

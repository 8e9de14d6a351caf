"""A request's life on the coordinator, and what callers get back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, StrEnum

from processors import SamplingParams
from workers.sampler import TokenLogprobs


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
class RequestOutput:
    """A snapshot of one request: cumulative text and tokens plus what is new since the last one."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    owner: int | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.finished_time = time.monotonic()

"""Building ``RequestOutput``s: text, logprob dicts and request groups, off the step's
critical path (the Ray engine builds step N's outputs while the workers compute step N+1).

Rows tell it what is due (``due``: finished, failed, aborted; ``stream``: gained tokens);
``take`` builds them, each with the text and tokens new since the last one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coordinator.output.detokenizer import IncrementalDetokenizer
from coordinator.request import CompletionOutput, Logprob, PositionLogprobs, Request, RequestGroup, RequestOutput
from workers.wire import TokenLogprobs


class OutputBuilder:
    def __init__(self, tokenizer: Any, detokenizers: dict[str, IncrementalDetokenizer]) -> None:
        self.tokenizer = tokenizer
        self.detokenizers = detokenizers  # by row id, shared with admission and acceptance
        self.emitted: dict[str, tuple[int, int]] = {}  # row id -> (text chars, tokens) already reported
        self.delivered: list[str] = []  # finished requests whose final output was taken
        self._pending: dict[str, RequestGroup] = {}
        self._streamed: list[Request] = []  # streaming rows that gained tokens; their outputs are built later
        self._token_texts: dict[int, str] = {}

    def register(self, row_id: str) -> None:
        self.emitted[row_id] = (0, 0)

    def forget(self, row_id: str) -> None:
        self.detokenizers.pop(row_id, None)
        self.emitted.pop(row_id, None)

    def due(self, group: RequestGroup) -> None:
        """``group`` has an output to deliver (finished, failed, aborted, or a row's tokens)."""
        self._pending[group.request_id] = group

    def reused(self, request_id: str) -> None:
        """A new request takes the id of a finished one: that one's undelivered output (an abort's, a
        failure's) is dropped, since a reader by id would take it for the new request's. Before, it was
        dropped only when the new request gained a token in the same step: delivery depended on timing."""
        self._pending.pop(request_id, None)

    def stream(self, requests: Iterable[Request]) -> None:
        """Streaming rows that gained tokens this step."""
        self._streamed.extend(requests)

    def take(self) -> list[RequestOutput]:
        """Outputs since the last call; the ids of finished ones are kept in ``delivered``."""
        for request in self._streamed:
            self._pending[request.group.request_id] = request.group
        self._streamed = []
        outputs = [self._output(g) for g in self._pending.values()]
        self._pending = {}
        self.delivered.extend(out.request_id for out in outputs if out.finished)
        return outputs

    def _logprob_dicts(self, request: Request) -> list[PositionLogprobs]:
        """vLLM's shape, converted once per position: the sampled token first, then the top ones."""
        done = request.logprob_dicts
        del done[len(request.logprobs):]
        for lp in request.logprobs[len(done):]:
            done.append(self._position(lp))
        return list(done)

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _completion(self, request: Request) -> CompletionOutput:
        detok = self.detokenizers.get(request.request_id)
        if detok is not None:
            detok.catch_up(request.output_token_ids)
            if request.finished and not isinstance(request.stop_reason, str):
                detok.flush()  # an incomplete last character too (idempotent)
        text = detok.visible_text(request.finished) if detok is not None else ""
        sent_chars, sent_tokens = self.emitted[request.request_id]
        self.emitted[request.request_id] = (len(text), len(request.output_token_ids))
        logprobs = self._logprob_dicts(request) if request.logprobs is not None else None
        return CompletionOutput(
            index=request.child_index,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=(sum(lp.sampled_logprob for lp in request.logprobs)
                                if request.logprobs is not None else None),
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            new_text=text[sent_chars:],
            new_token_ids=request.output_token_ids[sent_tokens:],
        )

    def _prompt_logprobs(self, group: RequestGroup) -> list[PositionLogprobs | None] | None:
        """vLLM's shape once every prompt position is known: None first, then {the prompt token, the top ones}."""
        known = group.prompt_logprobs
        if known is None or any(entry is None for entry in known[1:]):
            return None
        return [None] + [self._position(entry) for entry in known[1:]]

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        position = {lp.sampled_token_id: Logprob(lp.sampled_logprob, lp.sampled_rank,
                                                 self._token_text(lp.sampled_token_id))}
        for rank, (token, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
            position[token] = Logprob(value, rank, self._token_text(token))
        return position

    def _output(self, group: RequestGroup) -> RequestOutput:
        first = group.children[0]
        errors = [c.error for c in group.children if c.error]
        first_tokens = [c.first_token_time for c in group.children if c.first_token_time is not None]
        return RequestOutput(
            request_id=group.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(c) for c in group.children],
            finished=group.finished,
            error=errors[0] if errors else None,
            prompt_logprobs=self._prompt_logprobs(group),
            lora_request=first.params._lora,
            retryable=bool(errors) and all(c.retryable for c in group.children if c.error),
            refused=first.refused,
            arrival_time=first.arrival_time,
            first_token_time=min(first_tokens) if first_tokens else None,
            finished_time=max(c.finished_time for c in group.children) if group.finished else None,
        )

"""The OpenAI batch file format, as ``vllm run-batch`` reads and writes it.

Input lines: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``. Output lines: ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`` with an OpenAI
``chat.completion`` / ``text_completion`` body (``n`` choices, usage,
logprobs with token strings). A line that cannot run gets ``status_code``
400 and the reason in ``error``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from cluster.entrypoints.chat import RENDER_LIMIT_S, render_chat, request_template_kwargs
from cluster.entrypoints.job_lines import InputLimits, json_object
from coordinator.request import CompletionOutput, Logprob, RequestOutput, top_of
from processors import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

# Body fields that map one to one onto SamplingParams (vLLM's OpenAI server accepts these too).
_DIRECT = {"max_tokens", "temperature", "top_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty",
           "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
           "include_stop_str_in_output", "bad_words", "allowed_token_ids", "structured_outputs", "guided_json",
           "guided_regex", "guided_choice", "guided_grammar", "thinking_token_budget", "best_of"}
_IGNORED = {"model", "user", "stream_options", "service_tier", "store", "metadata"}
_REFUSED = {"tools": "tool calls are not supported", "tool_choice": "tool calls are not supported",
            "functions": "function calls are not supported", "suffix": "suffix is not supported",
            "audio": "audio output is not supported", "modalities": "only text is supported"}


class PromptParts(list):
    """A completions line's list of prompts: one engine request each, one response with every choice."""


class BatchLineError(ValueError):
    """A batch line cannot run; ``custom_id`` when the line had one."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


@dataclass
class BatchRequest:
    custom_id: str
    url: str
    prompt: str | list[int] | PromptParts
    params: SamplingParams
    top_logprobs: int | None  # chat: logprobs=true asks for these alternatives per token
    model: str | None
    echo: bool = False  # completions: the prompt comes back before the completion, logprobs included
    echo_only: bool = False  # echo with max_tokens 0 (scoring a prompt): the prompt alone comes back


def parse_batch_line(line: str, tokenizer: Any, defaults: dict[str, Any],
                     limits: InputLimits | None = None) -> BatchRequest:
    """One OpenAI batch line; ``limits``: the longest chat text that can fit (``coordinator.intake.prompt_limits``),
    the deepest nesting and the most requests a line may ask for."""
    record = json_object(line, BatchLineError, limits.max_json_depth if limits else 64)
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError("missing or non-string 'custom_id'")
    try:
        return _parse(record, custom_id, tokenizer, defaults, limits)
    except BatchLineError:
        raise
    except (ValueError, TypeError) as exc:
        raise BatchLineError(str(exc), custom_id) from None


def _parse(record: dict[str, Any], custom_id: str, tokenizer: Any, defaults: dict[str, Any],
           limits: InputLimits | None) -> BatchRequest:
    unknown = sorted(set(record) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    if record.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {record.get('method')!r}")
    url = record.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    body = record.get("body")
    if not isinstance(body, dict):
        raise ValueError("'body' must be an object")
    chat = url == CHAT_URL
    if body.get("stream"):
        raise ValueError("stream is not supported in a batch")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, [], False):
            raise ValueError(f"body.{name}: {why}")
    allowed = _DIRECT | _IGNORED | {"stream", "response_format", "vllm_xargs", "logit_bias", "logprobs"} | set(_REFUSED)
    allowed |= ({"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"} if chat
                else {"prompt", "echo", "prompt_logprobs"})
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(f"body has unknown field(s) {unknown}")
    params: dict[str, Any] = dict(defaults)
    params.update({k: v for k, v in body.items() if k in _DIRECT})
    if body.get("logit_bias") is not None:
        params["logit_bias"] = body["logit_bias"]
    if body.get("vllm_xargs") is not None:
        params["extra_args"] = body["vllm_xargs"]
    top_logprobs = None
    if chat:
        if body.get("max_completion_tokens") is not None:
            params["max_tokens"] = body["max_completion_tokens"]
        if body.get("logprobs"):
            top_logprobs = int(body.get("top_logprobs") or 0)
            params["logprobs"] = top_logprobs
        elif body.get("top_logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        prompt: str | list[int] = render_chat(tokenizer, body.get("messages"),
                                              request_template_kwargs(body.get("chat_template_kwargs")),
                                              max_chars=limits.max_prompt_chars if limits else None,
                                              time_limit_s=RENDER_LIMIT_S)
    else:
        if body.get("logprobs") is not None:
            params["logprobs"] = body["logprobs"]
        # vLLM's: echo with logprobs asks for the prompt's logprobs too (prompt_logprobs, unless given), and
        # max_tokens 0 scores the prompt alone (one token is generated and left out).
        echo = bool(body.get("echo"))
        params["prompt_logprobs"] = body.get("prompt_logprobs")
        if params["prompt_logprobs"] is None and echo:
            params["prompt_logprobs"] = body.get("logprobs")
        if echo and params.get("max_tokens") == 0:
            params["max_tokens"] = 1
            echo = "only"
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            # Several prompts, as OpenAI and vLLM take them: choices come prompt by prompt, n each.
            _check_fan_out(len(prompt), params.get("n", 1), limits)
            for p in prompt:
                _check_prompt(p)
            prompt = prompt[0] if len(prompt) == 1 else PromptParts(prompt)
        else:
            _check_prompt(prompt)
    if not isinstance(prompt, PromptParts):
        _check_fan_out(1, params.get("n", 1), limits)
    response_format = body.get("response_format")
    if response_format is not None:
        params["structured_outputs"] = _response_format(response_format)
    echoed = {} if chat else {"echo": bool(echo), "echo_only": echo == "only"}
    return BatchRequest(custom_id, url, prompt, SamplingParams.from_dict(params), top_logprobs, body.get("model"),
                        **echoed)


def _check_fan_out(num_prompts: int, n: Any, limits: InputLimits | None) -> None:
    """A line becomes ``prompts x n`` sequences: refused, before any is built, past the line cap."""
    cap = limits.max_requests_per_line if limits else None
    rows = num_prompts * (n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1)
    if cap is not None and rows > cap:
        raise ValueError(f"this line asks for {rows} sequences ({num_prompts} prompts x n={n}); a line may ask for "
                         f"at most {cap} (input.max_requests_per_line in the config); split it into several lines")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return
    raise ValueError("body.prompt must be a string, a list of token ids, or a list of these")


def _response_format(value: Any) -> dict[str, Any] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ValueError("response_format.json_schema.schema is missing")
        return {"json": schema}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "text":
        return None
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def _positions(completion: CompletionOutput, num_top: int) -> list[tuple[int, Logprob, list[tuple[int, Logprob]]]]:
    """(sampled token, its logprob, the top ones) per generated position."""
    assert completion.logprobs is not None
    return [(token, position[token], top_of(position, token, num_top))
            for token, position in zip(completion.token_ids, completion.logprobs)]


def _chat_logprobs(completion: CompletionOutput, num_top: int) -> dict[str, Any] | None:
    """Token texts are the engine's ``Logprob.decoded_token``: each token decoded once, by the coordinator."""
    if completion.logprobs is None:
        return None
    content = []
    for _, sampled, top in _positions(completion, num_top):
        text = sampled.decoded_token or ""
        content.append({
            "token": text, "logprob": sampled.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := lp.decoded_token or ""), "logprob": lp.logprob,
                              "bytes": list(t.encode())} for _, lp in top],
        })
    return {"content": content}


def _completion_logprobs(completion: CompletionOutput | None, num_top: int,
                         prompt: RequestOutput | None = None) -> dict[str, Any] | None:
    """OpenAI's completion logprobs; ``prompt``: echo, the prompt's positions first (the first one without a
    logprob, as vLLM leaves it). ``completion`` None: the prompt alone (echo with max_tokens 0)."""
    if (completion is not None and completion.logprobs is None) or (prompt is not None and prompt.prompt_logprobs is None):
        return None
    positions: list[tuple[str, float | None, dict[str, float] | None]] = []
    if prompt is not None:
        for token, position in zip(prompt.prompt_token_ids, prompt.prompt_logprobs):
            if position is None:
                positions.append((_token_text(prompt, token), None, None))
            else:
                top = top_of(position, token, num_top)[:num_top] if num_top else []
                positions.append((position[token].decoded_token or "", _finite(position[token].logprob),
                                  {lp.decoded_token or "": _finite(lp.logprob) for _, lp in top}))
    if completion is not None:
        positions += [(sampled.decoded_token or "", _finite(sampled.logprob),
                       {lp.decoded_token or "": _finite(lp.logprob) for _, lp in top})
                      for _, sampled, top in _positions(completion, num_top)]
    offsets, at = [], 0
    for text, _, _ in positions:
        offsets.append(at)
        at += len(text)
    return {"tokens": [p[0] for p in positions], "token_logprobs": [p[1] for p in positions],
            "top_logprobs": [p[2] for p in positions], "text_offset": offsets}


def _finite(logprob: float) -> float:
    """JSON has no -inf: OpenAI's (and vLLM's) stand-in."""
    return max(logprob, -9999.0)


def _token_text(out: RequestOutput, token: int) -> str:
    """The first prompt token's text, where no position of the prompt logprobs decoded it."""
    for position in out.prompt_logprobs or []:
        if position is not None and token in position:
            return position[token].decoded_token or ""
    return ""


def _prompt_text(out: RequestOutput) -> str:
    if out.prompt is not None:
        return out.prompt
    texts = [_token_text(out, out.prompt_token_ids[0])] if out.prompt_token_ids else []
    texts += [position[token].decoded_token or "" for token, position in
              zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [None])[1:]) if position is not None]
    return "".join(texts)


def _prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field of a choice: per position, token id -> logprob, rank, decoded token."""
    if out.prompt_logprobs is None:
        return None
    return [None if position is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                                     "decoded_token": lp.decoded_token}
                                           for t, lp in position.items()}
            for position in out.prompt_logprobs]


def _stable_id(prefix: str, custom_id: str) -> str:
    return f"{prefix}-{hashlib.blake2b(custom_id.encode(), digest_size=12).hexdigest()}"


def response_line(request: BatchRequest, out: RequestOutput | list[RequestOutput], model_name: str) -> dict[str, Any]:
    """``out``: the request's output, or one per prompt of a line with several (``PromptParts``)."""
    outs = out if isinstance(out, list) else [out]
    failed = next((o for o in outs if o.error is not None), None)
    if failed is not None:  # 500 for an engine-side failure (a resumed run retries it), else 400
        return error_line(request.custom_id, failed.error, status_code=500 if failed.retryable else 400)
    chat = request.url == CHAT_URL
    num_top = request.params.logprobs if request.params.logprobs is not None else 0
    choices = []
    for prompt_index, one in enumerate(outs):
        for c in one.outputs:
            reason = c.finish_reason.value if c.finish_reason else None
            index = prompt_index * len(one.outputs) + c.index
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": _chat_logprobs(c, num_top), "finish_reason": reason,
                                "stop_reason": c.stop_reason})
            else:
                text = c.text
                logprobs = _completion_logprobs(c, num_top) if request.params.logprobs is not None else None
                if request.echo:
                    text = _prompt_text(one) + ("" if request.echo_only else c.text)
                    if request.params.logprobs is not None:
                        logprobs = _completion_logprobs(None if request.echo_only else c, num_top, prompt=one)
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                          "stop_reason": c.stop_reason}
                if request.params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(one)
                choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for one in outs for c in one.outputs)
    prompt_tokens = sum(len(one.prompt_token_ids) for one in outs)
    body = {
        "id": _stable_id("chatcmpl" if chat else "cmpl", request.custom_id),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": request.model or model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    return {"id": _stable_id("batch_req", request.custom_id), "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": _stable_id("req", request.custom_id), "body": body},
            "error": None}


def error_line(custom_id: str | None, message: str, line_no: int | None = None,
               status_code: int = 400) -> dict[str, Any]:
    record = {"id": _stable_id("batch_req", custom_id or f"line-{line_no}"), "custom_id": custom_id,
              "response": {"status_code": status_code, "request_id": _stable_id("req", custom_id or f"line-{line_no}"),
                           "body": None},
              "error": message}
    if custom_id is None:
        record["line"] = line_no
    return record

"""Reading the job's input: lines streamed with a byte cap, ids, and one line into a request."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.entrypoints.chat import RENDER_LIMIT_S, render_chat, request_template_kwargs
from cluster.entrypoints.json_input import JSONLineError, load_json
from cluster.entrypoints.lora_names import LoraNames, UnknownModel
from coordinator.intake.prompt_limits import max_prompt_chars, too_long_message
from processors import LoRARequest, SamplingParams


def id_key(rid: Any) -> str:
    """Ids compare as strings: ``1`` and ``"1"`` name the same request."""
    return str(rid)


def line_digest(raw: bytes) -> str:
    """An error record is tied to the exact line it reports: a fixed line is a new line."""
    return hashlib.sha256(raw.strip()).hexdigest()[:32]


def engine_request_id(key: str) -> str:
    """The engine's id for a record: stable across runs, so an unseeded request draws the same random
    stream when a resumed job runs it again; ``#`` (the n > 1 row separator) is escaped."""
    return "job:" + key.replace("%", "%25").replace("#", "%23")


class BadLine(ValueError):
    """One input line cannot become a request; the job records it and goes on. ``status_code``: the HTTP
    status an OpenAI batch record gives it (vLLM's)."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True)
class InputLimits:
    """The most a line may bring: from the model (longer cannot fit in ``max_model_len`` tokens) and
    from the config's ``input`` section."""

    max_model_len: int
    max_prompt_chars: int  # coordinator.intake.prompt_limits
    max_json_depth: int = 64  # input.max_json_depth
    max_requests_per_line: int = 1024  # input.max_requests_per_line (run-batch: prompts x n)

    @property
    def max_line_bytes(self) -> int:
        """A JSON line spells a character in at most 6 bytes (``\\uXXXX``), plus room for its parameters."""
        return 6 * self.max_prompt_chars + (1 << 20)

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int, max_json_depth: int = 64,
           max_requests_per_line: int = 1024) -> InputLimits:
        return cls(max_model_len, max_prompt_chars(tokenizer, max_model_len), max_json_depth, max_requests_per_line)


def json_object(line: str, error: type[Exception], max_depth: int = 64) -> dict[str, Any]:
    """An input line as a JSON object, or ``error`` saying why it is not one (both input formats)."""
    try:
        record = load_json(line, max_depth)
    except JSONLineError as exc:
        raise error(str(exc)) from None
    if not isinstance(record, dict):
        raise error("each line must be a JSON object")
    return record


def parse_line(line: str, defaults: dict[str, Any], tokenizer: Any = None, limits: InputLimits | None = None,
               adapters: LoraNames | None = None) -> tuple[Any, str | list[int], SamplingParams]:
    """One input line; ``tokenizer``: a callable giving it (chat lines only); ``limits``: refuse what
    cannot fit before rendering or tokenizing anything; ``adapters``: the LoRA adapters a line's ``model``
    may name (None: a line may not name one)."""
    record = json_object(line, BadLine, limits.max_json_depth if limits else 64)
    if "id" not in record:
        raise BadLine("missing 'id'")
    rid = record["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise BadLine(f"'id' must be a non-empty string or an integer, got {json.dumps(rid)}")
    unknown = sorted(set(record) - {"id", "prompt", "prompt_token_ids", "messages", "chat_template_kwargs",
                                    "sampling_params", "extra_args", "vllm_xargs", "model"})
    if unknown:
        raise BadLine(f"unknown field(s) {unknown}")
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if k in record]
    if len(given) != 1:
        raise BadLine("give exactly one of 'prompt', 'prompt_token_ids' or 'messages'")
    has_text, has_ids = given == ["prompt"], given == ["prompt_token_ids"]
    if given == ["messages"]:
        try:
            record["prompt_token_ids"] = render_chat(tokenizer(), record["messages"],
                                                     request_template_kwargs(record.get("chat_template_kwargs")),
                                                     max_chars=limits.max_prompt_chars if limits else None,
                                                     time_limit_s=RENDER_LIMIT_S)
        except ValueError as exc:
            raise BadLine(str(exc)) from None
        has_ids = True
    prompt = record["prompt"] if has_text else record["prompt_token_ids"]
    if has_text and not isinstance(prompt, str):
        raise BadLine("'prompt' must be a string")
    if has_text and limits is not None and len(prompt) > limits.max_prompt_chars:
        raise BadLine(too_long_message(len(prompt), limits.max_prompt_chars, limits.max_model_len))
    if has_ids and not (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise BadLine("'prompt_token_ids' must be a list of integers")
    given_params = record.get("sampling_params")
    if given_params is not None and not isinstance(given_params, dict):
        raise BadLine(f"'sampling_params' must be an object, got {type(given_params).__name__}")
    params = dict(defaults)
    params.update(given_params or {})
    if "extra_args" in record and "vllm_xargs" in record:
        raise BadLine("give 'extra_args' or 'vllm_xargs' (its vLLM name), not both")
    extra = record.get("extra_args", record.get("vllm_xargs"))
    if extra is not None:
        if not isinstance(extra, dict):
            raise BadLine("'extra_args' must be an object")
        params["extra_args"] = {**(params.get("extra_args") or {}), **extra}
    try:
        sampling = SamplingParams.from_dict(params)
    except (ValueError, TypeError) as exc:
        raise BadLine(f"invalid sampling_params: {exc}") from None
    if record.get("model") is not None:
        sampling._lora = adapter_of(record["model"], adapters)
    if limits is not None and sampling.n > limits.max_requests_per_line:
        raise BadLine(f"n={sampling.n} sequences: a line may ask for at most {limits.max_requests_per_line} "
                      "(input.max_requests_per_line in the config)")
    return rid, prompt, sampling


def adapter_of(name: Any, adapters: LoraNames | None) -> LoRARequest | None:
    """The adapter a line's ``model`` names; ``BadLine`` (vLLM's 404) for a name nothing serves."""
    try:
        if adapters is None:
            raise UnknownModel(str(name))
        return adapters.request(name)
    except UnknownModel as exc:
        raise BadLine(str(exc), status_code=404) from None
    except ValueError as exc:
        raise BadLine(str(exc)) from None


UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class OversizedLine:
    """A line longer than any request can be: read through, never held (its first bytes and digest kept)."""

    size: int
    head: bytes
    digest: str


# Lines are counted before the model is known (resume, progress): no line is held longer than this then.
COUNTING_MAX_LINE_BYTES = 64 << 20


def input_lines(path: Path, max_bytes: int = COUNTING_MAX_LINE_BYTES) -> Iterator[tuple[int, bytes | OversizedLine]]:
    """(line number, raw bytes) of every non-blank line; decoding is per line, so bad bytes fail one line.
    A UTF-8 byte order mark opening the file is skipped (as ``utf-8-sig`` reads it). A line over
    ``max_bytes`` comes as an ``OversizedLine``: memory stays bounded whatever the input holds."""
    limit = max_bytes
    with path.open("rb") as f:
        line_no = 0
        while True:
            raw = f.readline(limit + 1)
            if not raw:
                return
            line_no += 1
            if line_no == 1 and raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM):]
            if len(raw) > limit and not raw.endswith(b"\n"):
                yield line_no, _read_through(f, raw)
                continue
            if raw.strip():
                yield line_no, raw


def _read_through(f: Any, head: bytes) -> OversizedLine:
    """The rest of an over-long line, consumed in chunks: its size and the digest ``line_digest`` would give."""
    digest = hashlib.sha256(head.lstrip())
    size = len(head)
    tail = b""
    while True:
        chunk = f.readline(1 << 20)
        size += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            tail = chunk.rstrip()
            break
        digest.update(chunk)
    digest.update(tail)
    return OversizedLine(size, head[:4096], digest.hexdigest()[:32])


def decode_line(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(f"line is not valid UTF-8 (byte {raw[exc.start]:#04x} at offset {exc.start})") from None

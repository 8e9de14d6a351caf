"""The two input formats: ``generate`` lines and OpenAI batch lines (``run-batch``), and which
lines of an input still need a record."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from cluster.background import in_background
from cluster.config import RaysampleConfig, resolve
from cluster.entrypoints.chat import load_tokenizer
from cluster.entrypoints.job_lines import (
    BadLine,
    InputLimits,
    adapter_of,
    OversizedLine,
    decode_line,
    id_key,
    input_lines,
    line_digest,
    parse_line,
)
from cluster.entrypoints.job_records import Written, error_record, read_records, result_record
from cluster.entrypoints.json_input import JSONLineError, load_json
from cluster.entrypoints.lora_names import LoraNames
from cluster.entrypoints.openai_batch import BatchLineError, error_line, parse_batch_line, response_line
from coordinator.request import RequestOutput
from processors import SamplingParams


class GenerateFormat:
    """raysample's JSONL: ``id`` and ``prompt`` / ``prompt_token_ids`` / ``messages``."""

    id_field = "id"

    def __init__(self, config: RaysampleConfig) -> None:
        self.config = config
        self._tokenizer: Future | None = None
        self._limits: InputLimits | None = None
        self.adapters = LoraNames.of(config)  # what a line's model may name

    def prefetch_tokenizer(self) -> None:
        """Load the tokenizer (chat templates, run-batch bodies) while the engine starts, not after."""
        if self._tokenizer is None:
            self._tokenizer = in_background(self._load_tokenizer, name="raysample-tokenizer")

    def _facts(self) -> Any:
        """The model's facts; the job resolved its configuration in preflight, a caller of its own may not have."""
        self.config = resolve(self.config)  # a no-op once resolved
        return self.config.facts

    def _load_tokenizer(self) -> Any:
        facts = self._facts()
        return load_tokenizer(facts.tokenizer, facts.trust_remote_code)

    def tokenizer(self) -> Any:
        return self._tokenizer.result() if self._tokenizer is not None else self._load_tokenizer()

    def limits(self) -> InputLimits:
        """What a line may bring at most, for this model and max_model_len (once)."""
        if self._limits is None:
            bounds = self.config.input
            self._limits = InputLimits.of(self.tokenizer(), self._facts().max_model_len,
                                          bounds.max_json_depth, bounds.max_requests_per_line)
        return self._limits

    def parse(self, line: str) -> tuple[Any, Any, str | list[int], SamplingParams]:
        rid, prompt, params = parse_line(line, self.config.defaults, self.tokenizer, self.limits(), self.adapters)
        return rid, (rid, params.logprobs, params.prompt_logprobs), prompt, params

    def peek(self, line: str) -> Any:
        """The line's id if it has a usable one; anything else (bad JSON, too deep) is ``parse``'s to report."""
        try:
            record = load_json(line, self.config.input.max_json_depth)
        except JSONLineError:
            return None
        rid = record.get(self.id_field) if isinstance(record, dict) else None
        return rid if usable_id(rid) else None

    def result(self, context: Any, out: RequestOutput) -> dict[str, Any]:
        rid, num_logprobs, num_prompt_logprobs = context
        return result_record(rid, out, num_logprobs, num_prompt_logprobs)

    def error(self, rid: Any, line_no: int, message: str, status_code: int = 400) -> dict[str, Any]:
        return error_record(rid, line_no, message)

    def written(self, path: Path) -> Written:
        """What the output already holds. A record is read for what its fields can mean and never
        trusted for their types (an output can be edited by hand): an id that is not a string or an
        integer, an ``input_sha`` that is not a string, a ``retryable`` that is not ``false``, mark nothing
        done, so that line runs again."""
        seen = Written()
        for record in read_records(path):
            if record.get("retryable", False) is not False:
                continue
            if record.get("error") is not None:
                digest = record.get("input_sha")
                if isinstance(digest, str) and digest:
                    seen.lines.add(digest)
            elif usable_id(rid := record.get(self.id_field)):
                seen.ids.add(id_key(rid))
        return seen


class OpenAIBatchFormat(GenerateFormat):
    """The OpenAI batch file format (``vllm run-batch``), keyed by ``custom_id``."""

    id_field = "custom_id"

    def parse(self, line: str) -> tuple[Any, Any, str | list[int], SamplingParams]:
        try:
            request = parse_batch_line(line, self.tokenizer(), self.config.defaults, self.limits())
        except BatchLineError as exc:
            raise BadLine(str(exc)) from None
        if request.model is not None:  # the base model, a LoRA module, or vLLM's 404 (OpenAIServing._check_model)
            request.params._lora = adapter_of(request.model, self.adapters)
        return request.custom_id, request, request.prompt, request.params

    def result(self, context: Any, out: RequestOutput) -> dict[str, Any]:
        return response_line(context, out, self.config.model.served_names()[0])

    def error(self, rid: Any, line_no: int, message: str, status_code: int = 400) -> dict[str, Any]:
        return error_line(rid if isinstance(rid, str) else None, message, line_no, status_code)


def usable_id(rid: Any) -> bool:
    """An id a line or a record can carry: a string or an integer (not a bool, a float or a container)."""
    return isinstance(rid, (str, int)) and not isinstance(rid, bool)


def peek_key(fmt: GenerateFormat, raw: bytes | OversizedLine) -> str | None:
    if isinstance(raw, OversizedLine):
        return None
    try:
        rid = fmt.peek(decode_line(raw))
    except BadLine:
        return None
    return None if rid is None else id_key(rid)


def digest_of(raw: bytes | OversizedLine) -> str:
    return raw.digest if isinstance(raw, OversizedLine) else line_digest(raw)


def pending_lines(fmt: GenerateFormat, input_path: Path, output_path: Path) -> tuple[int, int]:
    """(input lines, lines without a final record in the output yet): read before anything starts."""
    written = fmt.written(output_path)
    total = pending = 0
    for _, raw in input_lines(input_path):
        total += 1
        if not written.done(digest_of(raw), peek_key(fmt, raw)):
            pending += 1
    return total, pending

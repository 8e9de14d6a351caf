"""Batch generation from JSON lines: ``raysample generate`` / ``python -m cluster.job generate``.

    raysample generate --config configs/default.yaml --input prompts.jsonl --output results.jsonl
    ray job submit --working-dir . -- python -m cluster.job generate --config ... --input ... --output ...

Input lines: ``{"id": ..., "prompt": "..." | "prompt_token_ids": [...], "sampling_params": {...},
"extra_args": {...}}`` (``vllm_xargs`` is accepted for ``extra_args``). The input is streamed, the
engine kept full, each result written (and flushed) as it finishes. Rerunning with the same output
skips ids already written. A bad line or bad parameters give an error record for that line only;
the exit code is non-zero only when the job itself fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from cluster.background import in_background
from cluster.config import ConfigError, RaysampleConfig, load_config
from cluster.chat import RENDER_LIMIT_S, load_tokenizer, render_chat, request_template_kwargs
from cluster.job_paths import JobPathError, check_job_paths
from cluster.preflight import PreflightError, preflight
from cluster.quiet import quiet_libraries
from cluster.openai_batch import BatchLineError, PromptParts, error_line, parse_batch_line, response_line
from coordinator.prompt_limits import max_prompt_chars, too_long_message
from coordinator.request import CompletionOutput, RequestOutput, top_of
from processors import SamplingParams

logger = logging.getLogger("raysample.job")


class Backend(Protocol):
    def submit_many(self, prompts: Sequence[Any], params: Sequence[SamplingParams],
                    request_ids: Sequence[str | None] | None = None, final_only: bool = False) -> list[str]: ...
    def poll(self, request_ids: Sequence[str], timeout_s: float, finished_only: bool) -> list[RequestOutput]: ...
    def stats(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


class LocalBackend:
    """The in-process engine behind the same calls as the Ray handle (``--local``)."""

    def __init__(self, config: RaysampleConfig, engine: Any = None) -> None:
        """``engine``: an already built ``LocalEngine`` for ``config`` (tests share one)."""
        from cluster.local_engine import LocalEngine

        self.engine = engine if engine is not None else LocalEngine(config)

    def submit_many(self, prompts: Sequence[Any], params: Sequence[SamplingParams],
                    request_ids: Sequence[str | None] | None = None, final_only: bool = False) -> list[str]:
        return self.engine.submit_many(prompts, params, request_ids, final_only)

    def poll(self, request_ids: Sequence[str], timeout_s: float, finished_only: bool = True) -> list[RequestOutput]:
        return self.engine.poll(request_ids, timeout_s, finished_only)

    def stats(self) -> dict[str, Any]:
        m = self.engine.coordinator.metrics
        return {"spec_acceptance": m.spec_acceptance, "generated_tokens": m.generated_tokens,
                "tokens_per_s": m.generation_rate.rate(),
                **self.engine.coordinator.kv_stats(), "kv_cache": self.engine.coordinator.kv_summary()}

    def shutdown(self) -> None:
        pass


@dataclass
class JobCounters:
    total_lines: int
    skipped: int = 0  # already in the output (resume)
    done: int = 0
    errors: int = 0
    retryable: int = 0  # of the errors, the engine's own failures: a resumed run retries them
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    first_result: float | None = None

    def rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)


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
    """One input line cannot become a request; the job records it and goes on."""


@dataclass(frozen=True)
class InputLimits:
    """The most a line may bring, from the model: longer cannot fit in ``max_model_len`` tokens."""

    max_model_len: int
    max_prompt_chars: int  # coordinator.prompt_limits

    @property
    def max_line_bytes(self) -> int:
        """A JSON line spells a character in at most 6 bytes (``\\uXXXX``), plus room for its parameters."""
        return 6 * self.max_prompt_chars + (1 << 20)

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> InputLimits:
        return cls(max_model_len, max_prompt_chars(tokenizer, max_model_len))


def parse_line(line: str, defaults: dict[str, Any], tokenizer: Any = None, limits: InputLimits | None = None
               ) -> tuple[Any, str | list[int], SamplingParams]:
    """One input line; ``tokenizer``: a callable giving it (chat lines only); ``limits``: refuse what
    cannot fit before rendering or tokenizing anything."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not valid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise BadLine("each line must be a JSON object")
    if "id" not in record:
        raise BadLine("missing 'id'")
    rid = record["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise BadLine(f"'id' must be a non-empty string or an integer, got {json.dumps(rid)}")
    unknown = sorted(set(record) - {"id", "prompt", "prompt_token_ids", "messages", "chat_template_kwargs",
                                    "sampling_params", "extra_args", "vllm_xargs"})
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
        return rid, prompt, SamplingParams.from_dict(params)
    except (ValueError, TypeError) as exc:
        raise BadLine(f"invalid sampling_params: {exc}") from None


def completion_record(completion: CompletionOutput, num_logprobs: int | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason.value if completion.finish_reason else None,
        "stop_reason": completion.stop_reason,
    }
    if completion.logprobs is not None:
        k = -1 if num_logprobs is None else num_logprobs
        record["logprobs"] = [
            {"token_id": token, "logprob": position[token].logprob, "rank": position[token].rank,
             "top": [[t, lp.logprob] for t, lp in top_of(position, token, k)]}
            for token, position in zip(completion.token_ids, completion.logprobs)
        ]
    return record


def result_record(rid: Any, out: RequestOutput, num_logprobs: int | None = None) -> dict[str, Any]:
    """The first completion's fields at the top level; with n > 1 every completion under ``outputs``."""
    record: dict[str, Any] = {"id": rid, **completion_record(out.outputs[0], num_logprobs), "error": out.error,
                              "prompt_tokens": len(out.prompt_token_ids)}
    if len(out.outputs) > 1:
        record["outputs"] = [{"index": c.index, **completion_record(c, num_logprobs)} for c in out.outputs]
    end = out.finished_time or time.monotonic()
    record["timing"] = {
        "first_token_s": None if out.first_token_time is None else round(out.first_token_time - out.arrival_time, 4),
        "total_s": round(end - out.arrival_time, 4),
    }
    return record


def error_record(rid: Any, line_no: int, message: str) -> dict[str, Any]:
    return {"id": rid, "line": line_no, "error": message, "finish_reason": "error"}


@dataclass
class Written:
    """What an existing output already holds, as resume sees it.

    Done: ids with a result, and lines whose exact content got a request-level error (bad
    JSON, bad parameters). Engine-side failures (``retryable``) are not done: they run again.
    """

    ids: set[str] = field(default_factory=set)
    lines: set[str] = field(default_factory=set)  # line_digest of lines with a final error record

    def done(self, digest: str, key: str | None) -> bool:
        return digest in self.lines or (key is not None and key in self.ids)


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Records of an existing output; a torn last line from a crash is skipped (and later overwritten)."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                yield record


class GenerateFormat:
    """raysample's JSONL: ``id`` and ``prompt`` / ``prompt_token_ids`` / ``messages``."""

    id_field = "id"

    def __init__(self, config: RaysampleConfig) -> None:
        self.config = config
        self._tokenizer: Future | None = None
        self._limits: InputLimits | None = None

    def prefetch_tokenizer(self) -> None:
        """Load the tokenizer (chat templates, run-batch bodies) while the engine starts, not after."""
        if self._tokenizer is None:
            self._tokenizer = in_background(self._load_tokenizer, name="raysample-tokenizer")

    def _load_tokenizer(self) -> Any:
        model = self.config.model
        return load_tokenizer(model.tokenizer or model.resolve_path(), model.trust_remote_code)

    def tokenizer(self) -> Any:
        return self._tokenizer.result() if self._tokenizer is not None else self._load_tokenizer()

    def limits(self) -> InputLimits:
        """What a line may bring at most, for this model and max_model_len (once)."""
        if self._limits is None:
            from transformers import AutoConfig

            from workers.model_support import resolved_max_model_len

            model = self.config.model
            model_config = AutoConfig.from_pretrained(model.resolve_path(), trust_remote_code=model.trust_remote_code)
            self._limits = InputLimits.of(self.tokenizer(), resolved_max_model_len(model_config, model.max_model_len))
        return self._limits

    def parse(self, line: str) -> tuple[Any, Any, str | list[int], SamplingParams]:
        rid, prompt, params = parse_line(line, self.config.defaults, self.tokenizer, self.limits())
        return rid, (rid, params.logprobs), prompt, params

    def peek(self, line: str) -> Any:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return None
        rid = record.get(self.id_field) if isinstance(record, dict) else None
        return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None

    def result(self, context: Any, out: RequestOutput) -> dict[str, Any]:
        rid, num_logprobs = context
        return result_record(rid, out, num_logprobs)

    def error(self, rid: Any, line_no: int, message: str) -> dict[str, Any]:
        return error_record(rid, line_no, message)

    def written(self, path: Path) -> Written:
        seen = Written()
        for record in read_records(path):
            if record.get("retryable"):
                continue
            if record.get("error") is not None:
                if record.get("input_sha"):
                    seen.lines.add(record["input_sha"])
            elif record.get(self.id_field) is not None:
                seen.ids.add(id_key(record[self.id_field]))
        return seen


class OpenAIBatchFormat(GenerateFormat):
    """The OpenAI batch file format (``vllm run-batch``), keyed by ``custom_id``."""

    id_field = "custom_id"

    def parse(self, line: str) -> tuple[Any, Any, str | list[int], SamplingParams]:
        try:
            request = parse_batch_line(line, self.tokenizer(), self.config.defaults, self.limits().max_prompt_chars)
        except BatchLineError as exc:
            raise BadLine(str(exc)) from None
        return request.custom_id, request, request.prompt, request.params

    def result(self, context: Any, out: RequestOutput) -> dict[str, Any]:
        name = self.config.model.display_name()
        return response_line(context, out, name)

    def error(self, rid: Any, line_no: int, message: str) -> dict[str, Any]:
        return error_line(rid if isinstance(rid, str) else None, message, line_no)


def _open_for_append(path: Path) -> TextIO:
    """Append, first dropping a torn (unterminated) last line left by an interrupted run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            path.write_bytes(data[: data.rfind(b"\n") + 1])
    return path.open("a", encoding="utf-8")


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


def describe_start(config: RaysampleConfig, local: bool) -> str:
    """What is being started, said before the seconds it takes."""
    model, cluster = config.model, config.cluster
    name = model.display_name()
    if local:
        return f"{name} in this process (--local)"
    device = f"{cluster.gpus_per_worker:g} GPU" if cluster.gpus_per_worker else f"{cluster.cpus_per_worker:g} CPU"
    if cluster.address == "local" and os.environ.get("RAY_ADDRESS"):
        where = "the Ray job's cluster"
    elif cluster.address == "local":
        where = "a private Ray instance"
    else:
        where = f"the Ray cluster at {cluster.address}"
    engines = f"{cluster.num_engines} engines x " if cluster.num_engines > 1 else ""
    return f"{name} on {engines}{cluster.num_workers} worker(s) of {device} each, on {where}"


class Progress:
    """A tqdm bar on a terminal, log lines every ``every_s`` otherwise."""

    def __init__(self, counters: JobCounters, every_s: float) -> None:
        self.counters = counters
        self.every_s = every_s
        self.last_log = time.monotonic()
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=counters.total_lines, initial=counters.skipped, unit="req", dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        c = self.counters
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(tok_s=f"{c.rate():.0f}", errors=c.errors)
        elif time.monotonic() - self.last_log >= self.every_s:
            self.last_log = time.monotonic()
            finished = c.done + c.errors + c.skipped
            left = c.total_lines - finished
            per_req = (time.monotonic() - c.started) / max(c.done + c.errors, 1)
            print(f"[raysample] {finished}/{c.total_lines} requests, {c.rate():.0f} tokens/s, "
                  f"ETA {left * per_req:.0f}s, {c.errors} errors", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_job(config: RaysampleConfig, backend: Backend, input_path: Path, output_path: Path,
            max_in_flight: int, show: int = 0, log_every_s: float = 10.0,
            line_format: GenerateFormat | None = None) -> JobCounters:
    fmt = line_format or GenerateFormat(config)
    written = fmt.written(output_path)
    max_bytes = fmt.limits().max_line_bytes
    counters = JobCounters(total_lines=sum(1 for _ in input_lines(input_path, max_bytes)))
    progress = Progress(counters, log_every_s)
    seen: set[str] = set()
    in_flight: dict[str, tuple[InFlight, int]] = {}  # engine request id -> its line, and which of its prompts
    shown = 0
    with _open_for_append(output_path) as sink:

        def write(record: dict[str, Any], digest: str) -> None:
            if record.get("error") is not None:
                record["input_sha"] = digest  # ties the error to this exact line (see Written)
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()

        def reject(rid: Any, line_no: int, digest: str, message: str) -> None:
            write(fmt.error(rid, line_no, message), digest)
            counters.errors += 1
            progress.advance()

        lines = input_lines(input_path, max_bytes)
        exhausted = False
        while not exhausted or in_flight:
            batch: list[tuple[Any, Any, Any, SamplingParams, str]] = []
            while not exhausted and len(in_flight) + len(batch) < max_in_flight:
                item = next(lines, None)
                if item is None:
                    exhausted = True
                    break
                line_no, raw = item
                digest, key = digest_of(raw), peek_key(fmt, raw)
                # One rule for ids: the first line with an id takes it, whatever becomes of that line
                # (result or error, in this run or an earlier one); a later line with it is a duplicate.
                if written.done(digest, None) or (key is not None and key in written.ids and key not in seen):
                    counters.skipped += 1  # a final record exists (resume)
                    if key is not None:
                        seen.add(key)
                    continue
                if isinstance(raw, OversizedLine):
                    reject(None, line_no, digest, f"line is {raw.size} bytes: more than any request that fits "
                                                  f"max_model_len={fmt.limits().max_model_len} tokens can need "
                                                  f"({max_bytes} bytes); it was not read")
                    continue
                shown_id = fmt.peek(raw.decode("utf-8", "replace"))
                if key is not None and key in seen:
                    reject(shown_id, line_no, digest, f"duplicate id {shown_id!r}: an earlier line has it")
                    continue
                if key is not None:
                    seen.add(key)
                try:
                    rid, context, prompt, params = fmt.parse(decode_line(raw))
                except BadLine as exc:
                    reject(shown_id, line_no, digest, str(exc))
                    continue
                batch.append((rid, context, prompt, params, digest))
            if batch:
                requests = [(part_id, part, params, (line, i)) for rid, context, prompt, params, digest in batch
                            for line in [InFlight(rid, context, digest, [None] * len(parts_of(prompt)))]
                            for i, (part_id, part) in enumerate(zip(part_ids(rid, prompt), parts_of(prompt)))]
                ids = backend.submit_many([r[1] for r in requests], [r[2] for r in requests],
                                          [r[0] for r in requests], final_only=True)
                in_flight.update({eid: r[3] for eid, r in zip(ids, requests)})
            if in_flight:
                for out in backend.poll(list(in_flight), 1.0, True):
                    if counters.first_result is None:
                        counters.first_result = time.monotonic()
                    line, index = in_flight.pop(out.request_id)
                    line.outs[index] = out
                    if None in line.outs:
                        continue  # a line of several prompts is written when all are done
                    rid, outs = line.rid, line.outs
                    record = fmt.result(line.context, outs if len(outs) > 1 else outs[0])
                    failed = next((o for o in outs if o.error is not None), None)
                    if failed is not None and failed.retryable:
                        record["retryable"] = True  # an engine failure: a resumed run retries it
                        counters.retryable += 1
                    write(record, line.digest)
                    counters.tokens += sum(len(o.token_ids) for o in outs)
                    out = failed or outs[0]
                    if out.error:
                        counters.errors += 1
                    else:
                        counters.done += 1
                    if shown < show:
                        shown += 1
                        shown_text = f"error: {out.error}" if out.error else repr(out.text)
                        print(f"[raysample] {rid!r} ({out.finish_reason.value}): {shown_text}", flush=True)
                    progress.advance()
    progress.close()
    return counters


@dataclass
class InFlight:
    """A line whose request(s) the engine runs: several for a run-batch line with a list of prompts."""

    rid: Any
    context: Any
    digest: str
    outs: list[RequestOutput | None]


def parts_of(prompt: Any) -> list[Any]:
    return list(prompt) if isinstance(prompt, PromptParts) else [prompt]


def part_ids(rid: Any, prompt: Any) -> list[str]:
    """Engine ids: the line's, and for several prompts ``<id>%p<i>`` (an escaped id has no bare ``%p``)."""
    base = engine_request_id(id_key(rid))
    if not isinstance(prompt, PromptParts):
        return [base]
    return [f"{base}%p{i}" for i in range(len(prompt))]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class OutputLocked(RuntimeError):
    """The output cannot be held: another job is writing it, or it cannot be written at all."""


def lock_output(path: Path) -> TextIO:
    """Hold an exclusive lock on the output for the job's lifetime: two writers would duplicate every id."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a", encoding="utf-8")
    except OSError as exc:
        raise OutputLocked(f"--output {path} cannot be written: {exc.strerror or exc}") from None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise OutputLocked(f"{path} is being written by another raysample job; wait for it to finish or choose "
                           "another --output") from None
    return handle


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raysample", description="Batch LLM generation on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for every line of a JSONL file")
    gen.add_argument("--config", required=True, type=Path, help="YAML config (see configs/)")
    gen.add_argument("--input", required=True, type=Path, help="JSON lines with id, prompt, sampling_params")
    gen.add_argument("--output", required=True, type=Path, help="JSON lines results; resumed if it exists")
    gen.add_argument("--overwrite", action="store_true", help="start the output afresh instead of resuming")
    gen.add_argument("--local", action="store_true", help="run the engine in this process instead of on Ray")
    gen.add_argument("--max-in-flight", type=positive_int, default=None, help="requests submitted ahead (default 2 x max_num_seqs)")
    gen.add_argument("--show", type=int, default=0, help="print the first N results")
    gen.add_argument("--log-every", type=float, default=10.0, help="seconds between log lines when not on a terminal")
    gen.add_argument("--verbose", action="store_true", help="full tracebacks")
    gen.add_argument("--job-name", default=None,
                     help="the engine's name on the cluster (Engine.connect(name)); default: a new unique one")
    batch = sub.add_parser("run-batch", help="an OpenAI batch file (as vllm run-batch): chat and completions lines")
    batch.add_argument("-i", "--input-file", dest="input", required=True, type=Path, help="OpenAI batch JSONL")
    batch.add_argument("-o", "--output-file", dest="output", required=True, type=Path, help="results; resumed if it exists")
    batch.add_argument("--config", required=True, type=Path, help="YAML config (see configs/)")
    for flag, kwargs in (("--overwrite", {"action": "store_true"}), ("--local", {"action": "store_true"}),
                         ("--max-in-flight", {"type": positive_int, "default": None}), ("--show", {"type": int, "default": 0}),
                         ("--log-every", {"type": float, "default": 10.0}), ("--verbose", {"action": "store_true"}),
                         ("--job-name", {"default": None})):
        batch.add_argument(flag, **kwargs)
    return parser


def interrupted_message(output: Path) -> str:
    return (f"\nraysample: interrupted; the results so far are in {output}. Re-running the same command "
            "resumes where this run stopped.")


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:  # at any point: starting up included; every result so far is written
        print(interrupted_message(args.output), file=sys.stderr, flush=True)
        return 130


def _run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        if args.job_name:
            config = config.model_copy(update={"cluster": config.cluster.model_copy(
                update={"coordinator_name": args.job_name})})
        check_job_paths(args.input, args.output, args.config)
    except (ConfigError, JobPathError) as exc:
        print(f"raysample: {exc}", file=sys.stderr)
        return 2
    line_format = OpenAIBatchFormat(config) if args.command == "run-batch" else GenerateFormat(config)
    if args.overwrite:
        total = pending = sum(1 for _ in input_lines(args.input))
    else:
        total, pending = pending_lines(line_format, args.input, args.output)
    if pending == 0:
        print(f"[raysample] nothing to do: all {total} lines of {args.input} already have a record in {args.output} "
              "(--overwrite starts afresh)", flush=True)
        return 0
    if args.verbose:
        os.environ["RAYSAMPLE_VERBOSE"] = "1"  # a private instance's engine processes inherit it
    else:
        quiet_libraries()
    try:
        preflight(config, args.local)
    except PreflightError as exc:
        print(f"raysample: {exc}", file=sys.stderr)
        return 2
    try:
        lock = lock_output(args.output)  # held until this process exits
    except OutputLocked as exc:
        print(f"raysample: {exc}", file=sys.stderr)
        return 2
    if args.overwrite:
        lock.truncate(0)
    resumed = f" ({total - pending} already in {args.output})" if pending < total else ""
    print(f"[raysample] starting {describe_start(config, args.local)} for {pending} request(s){resumed}", flush=True)
    line_format.prefetch_tokenizer()
    ray_up = time.monotonic()
    try:
        if args.local:
            backend: Backend = LocalBackend(config)
        else:
            from cluster.client import Engine
            from cluster.ray_cluster import ensure_ray

            ensure_ray(config)
            ray_up = time.monotonic()
            backend = Engine.from_config(config)
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"raysample: the engine could not start: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
              " (--verbose shows the traceback)", file=sys.stderr)
        return 1
    try:
        name = getattr(backend, "name", None)
        print(f"[raysample] {'engine ' + name + ': ' if name else ''}{backend.stats()['kv_cache']}", flush=True)
        counters = run_job(config, backend, args.input, args.output,
                           args.max_in_flight or 2 * config.scheduler.max_num_seqs, args.show, args.log_every,
                           line_format)
        stats = backend.stats()
    except KeyboardInterrupt:
        # Every result so far was written and flushed as it finished; nothing is torn.
        print(interrupted_message(args.output), file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"raysample: the job failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        try:
            backend.shutdown()
        except KeyboardInterrupt:
            pass
    elapsed = time.monotonic() - counters.started
    acceptance = stats.get("spec_acceptance")
    where = "the engine started (--local)" if args.local else "Ray was up"
    first = "" if counters.first_result is None else f"; first result {counters.first_result - ray_up:.1f}s after {where}"
    print(
        f"[raysample] summary: {counters.done} requests done, {counters.errors} errors, "
        f"{counters.skipped} skipped (already in {args.output}); {counters.tokens} tokens in {elapsed:.1f}s "
        f"= {counters.rate():.0f} tokens/s; spec acceptance "
        + ("n/a" if acceptance is None else f"{acceptance:.0%}") + first,
        flush=True,
    )
    if counters.retryable:  # the engine failed them, not the requests: the caller should resume
        print(f"raysample: {counters.retryable} request(s) failed because the engine did (written with "
              f"\"retryable\": true); re-running the same command retries them", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

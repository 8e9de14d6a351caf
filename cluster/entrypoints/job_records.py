"""Writing the job's output: one JSON record per result or error, flushed as it finishes;
reading it back to resume; the lock that keeps a second job off the same output."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from coordinator.request import CompletionOutput, RequestOutput, top_of


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


def prompt_logprobs_record(out: RequestOutput, num_top: int) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt logprobs as JSON: null for the first token, then each prompt token's logprob and rank and
    the ``num_top`` most likely ones (``[token, logprob]``), the shape of a completion's ``logprobs``."""
    if out.prompt_logprobs is None:
        return None
    record: list[dict[str, Any] | None] = [None]
    for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        top = top_of(position, token, num_top)[:num_top] if num_top else []
        record.append({"token_id": token, "logprob": position[token].logprob, "rank": position[token].rank,
                       "top": [[t, lp.logprob] for t, lp in top]})
    return record


def result_record(rid: Any, out: RequestOutput, num_logprobs: int | None = None,
                  num_prompt_logprobs: int | None = None) -> dict[str, Any]:
    """The first completion's fields at the top level; with n > 1 every completion under ``outputs``."""
    record: dict[str, Any] = {"id": rid, **completion_record(out.outputs[0], num_logprobs), "error": out.error,
                              "prompt_tokens": len(out.prompt_token_ids)}
    if out.prompt_logprobs is not None:
        record["prompt_logprobs"] = prompt_logprobs_record(out, num_prompt_logprobs or 0)
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


def parse_record(raw: bytes) -> dict[str, Any] | None:
    """One output line as a record, or None for a torn one (cut short, overwritten, not an object)."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return record if isinstance(record, dict) else None


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Records of an existing output; torn lines are skipped (``set_aside_torn`` moves them out)."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for raw in f:
            if raw.strip() and (record := parse_record(raw)) is not None:
                yield record


def rejected_path(path: Path) -> Path:
    return path.with_name(path.name + ".rejected")


class OutputUnwritable(RuntimeError):
    """The output, or a file the job keeps beside it, cannot be written: one line, exit 2."""


def set_aside_torn(path: Path) -> int:
    """Move every torn line of an existing output to ``<output>.rejected`` (appended), leaving valid JSONL.

    A torn record (a crash mid-write, a full disk, an edit) was skipped on resume, so its id ran
    again, but the file stayed unparseable. The output is rewritten only when a torn line is found:
    into a temporary file beside it, then renamed over it (a crash leaves the old file or the new).
    A symlinked output is rewritten where it points (the link stays a link). Returns how many lines
    were set aside; the caller must lock the new file again. ``OutputUnwritable`` when the rejected
    file or the rewrite cannot be written; then nothing has changed and no temporary file is left."""
    if not path.exists() or not path.stat().st_size:
        return 0
    with path.open("rb") as f:
        if all(parse_record(raw) is not None for raw in f if raw.strip()):
            return 0
    real = Path(os.path.realpath(path))  # rename over the target, not over the link
    temp = real.with_name(f".{real.name}.{os.getpid()}.tmp")
    rejected_file = rejected_path(path)
    torn = 0
    existed = os.path.lexists(rejected_file)
    rejected_size = rejected_file.stat().st_size if rejected_file.is_file() else None
    try:
        with rejected_file.open("ab") as rejected, path.open("rb") as f, temp.open("wb") as kept:
            for raw in f:
                if not raw.strip():
                    continue
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                if parse_record(raw) is None:
                    rejected.write(line)
                    torn += 1
                else:
                    kept.write(line)
            rejected.flush()
            os.fsync(rejected.fileno())
            kept.flush()
            os.fsync(kept.fileno())
        shutil.copymode(real, temp)
        os.replace(temp, real)
    except OSError as exc:
        if not existed:
            rejected_file.unlink(missing_ok=True)
        elif rejected_size is not None:
            _undo_rejected(rejected_file, rejected_size)
        where = exc.filename or path
        raise OutputUnwritable(f"{torn or 'some'} torn record(s) in {path} must be moved aside, but {where} cannot "
                               f"be written ({exc.strerror or exc}); fix that or start afresh with --overwrite"
                               ) from None
    finally:
        temp.unlink(missing_ok=True)
    return torn


def _undo_rejected(rejected_file: Path, size: int) -> None:
    """Put ``<output>.rejected`` back as it was before a rewrite that failed (its lines stay in the output)."""
    try:
        if rejected_file.stat().st_size > size:
            os.truncate(rejected_file, size)
    except OSError:
        pass


def open_for_append(path: Path) -> TextIO:
    """Append, first dropping a torn (unterminated) last line left by an interrupted run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            path.write_bytes(data[: data.rfind(b"\n") + 1])
    return path.open("a", encoding="utf-8")


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

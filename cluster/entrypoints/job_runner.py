"""Running a job: stream the input into the engine, keep it full, write each result as it finishes."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import RaysampleConfig
from cluster.engine.engine_api import RequestAPI
from cluster.entrypoints.job_formats import GenerateFormat, digest_of, peek_key
from cluster.entrypoints.job_lines import BadLine, OversizedLine, decode_line, engine_request_id, id_key, input_lines
from cluster.entrypoints.job_progress import JobCounters, Progress
from cluster.entrypoints.job_records import open_for_append
from cluster.entrypoints.openai_batch import PromptParts
from coordinator.intake.prefix_order import prefix_order
from coordinator.request import RequestOutput
from processors import SamplingParams

DRAIN_S = 30.0  # how long a stopped engine's in-flight results are awaited before the job ends without them


def run_job(config: RaysampleConfig, backend: RequestAPI, input_path: Path, output_path: Path,
            max_in_flight: int, show: int = 0, log_every_s: float = 10.0,
            line_format: GenerateFormat | None = None) -> JobCounters:
    """Run every line of ``input_path`` not already final in ``output_path``; the engine refusing more (it stopped)
    is raised once the lines it was running are written."""
    fmt = line_format or GenerateFormat(config)
    counters = JobCounters(total_lines=sum(1 for _ in input_lines(input_path, fmt.limits().max_line_bytes)))
    with open_for_append(output_path) as sink:
        job = JobRun(config, backend, fmt, fmt.written(output_path), counters, Progress(counters, log_every_s), sink,
                     show)
        job.run(input_lines(input_path, fmt.limits().max_line_bytes), max_in_flight)
    job.progress.close()
    if job.stopped is not None:
        raise job.stopped
    return counters


class JobRun:
    """One pass over a job's input: lines parsed and read ahead, submitted while the engine has room, each
    result written as its line completes."""

    def __init__(self, config: RaysampleConfig, backend: RequestAPI, fmt: GenerateFormat, written: Any,
                 counters: JobCounters, progress: Progress, sink: Any, show: int) -> None:
        self.config, self.backend, self.fmt, self.written = config, backend, fmt, written
        self.counters, self.progress, self.sink, self.show = counters, progress, sink, show
        self.seen: set[str] = set()
        self.in_flight: dict[str, tuple[InFlight, int]] = {}  # engine request id -> its line, which of its prompts
        self.shown = 0
        self.exhausted = False
        self.stopped: Exception | None = None  # the engine's refusal of a submit, raised once in-flight lines are written

    def run(self, lines: Iterator[tuple[int, bytes | OversizedLine]], max_in_flight: int) -> None:
        ready: deque[Parsed] = deque()
        drain_until = 0.0
        while not self.exhausted or ready or self.in_flight:
            batch: list[Parsed] = []
            while len(self.in_flight) + len(batch) < max_in_flight:
                if not ready:
                    ready.extend(self.next_window(lines))
                    if not ready:
                        break
                batch.append(ready.popleft())
            if batch and not self.submit(batch):
                # The engine refuses more (it stopped): what it was running has failed with the reason, and
                # those records are written before the job ends; the lines never submitted get none.
                self.exhausted, drain_until = True, time.monotonic() + DRAIN_S
                ready.clear()
            if self.in_flight:
                if self.stopped is not None and time.monotonic() > drain_until:
                    break
                for out in self.backend.poll(list(self.in_flight), 1.0, True):
                    self.finished(out)

    def write(self, record: dict[str, Any], digest: str) -> None:
        if record.get("error") is not None:
            record["input_sha"] = digest  # ties the error to this exact line (see Written)
        self.sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.sink.flush()

    def reject(self, rid: Any, line_no: int, digest: str, message: str, status_code: int = 400) -> None:
        self.write(self.fmt.error(rid, line_no, message, status_code), digest)
        self.counters.error(line_no, rid, message)
        self.progress.advance()

    def parsed(self, item: tuple[int, bytes | OversizedLine]) -> Parsed | None:
        """The line ready to run, or None: skipped (a final record exists) or rejected (its error record written)."""
        fmt, seen = self.fmt, self.seen
        line_no, raw = item
        digest, key = digest_of(raw), peek_key(fmt, raw)
        # One rule for ids: the first line with an id takes it, whatever becomes of that line
        # (result or error, in this run or an earlier one); a later line with it is a duplicate.
        if self.written.done(digest, None) or (key is not None and key in self.written.ids and key not in seen):
            self.counters.skipped += 1  # a final record exists (resume)
            if key is not None:
                seen.add(key)
            return None
        if isinstance(raw, OversizedLine):
            limits = fmt.limits()
            self.reject(None, line_no, digest, f"line is {raw.size} bytes: more than any request that fits "
                                               f"max_model_len={limits.max_model_len} tokens can need "
                                               f"({limits.max_line_bytes} bytes); it was not read")
            return None
        shown_id = fmt.peek(raw.decode("utf-8", "replace"))
        if key is not None and key in seen:
            self.reject(shown_id, line_no, digest, f"duplicate id {shown_id!r}: an earlier line has it")
            return None
        if key is not None:
            seen.add(key)
        try:
            rid, context, prompt, params = fmt.parse(decode_line(raw))
        except BadLine as exc:
            self.reject(shown_id, line_no, digest, str(exc), exc.status_code)
            return None
        return Parsed(rid, context, prompt, params, digest, len(raw), line_no)

    def next_window(self, lines: Iterator[tuple[int, bytes | OversizedLine]]) -> list[Parsed]:
        """The next lines to run, read ahead up to input.read_ahead_lines/_bytes, shared prefixes side by side."""
        bounds = self.config.input
        window: list[Parsed] = []
        size = 0
        while not self.exhausted and len(window) < bounds.read_ahead_lines and size < bounds.read_ahead_bytes:
            if window and not bounds.group_by_prefix:
                break  # input order: no need to read ahead
            item = next(lines, None)
            if item is None:
                self.exhausted = True
                break
            entry = self.parsed(item)
            if entry is not None:
                window.append(entry)
                size += entry.size
        if not bounds.group_by_prefix or len(window) < 2:
            return window
        return [window[i] for i in prefix_order([next(iter(parts_of(e.prompt)), None) for e in window])]

    def submit(self, batch: list[Parsed]) -> bool:
        """Every prompt of these lines submitted; False where the engine refused them (it stopped) while lines
        were in flight (with none, the refusal is raised)."""
        requests = [(part_id, part, e.params, (line, i)) for e in batch
                    for line in [InFlight(e.rid, e.context, e.digest, [None] * len(parts_of(e.prompt)), e.line_no)]
                    for i, (part_id, part) in enumerate(zip(part_ids(e.rid, e.prompt), parts_of(e.prompt)))]
        try:
            ids = self.backend.submit_many([r[1] for r in requests], [r[2] for r in requests],
                                           [r[0] for r in requests], final_only=True)
        except Exception as exc:
            if not self.in_flight:
                raise
            self.stopped = exc
            return False
        self.in_flight.update({eid: r[3] for eid, r in zip(ids, requests)})
        return True

    def finished(self, out: RequestOutput) -> None:
        """A request's final output; its line's record is written once every prompt of the line is done."""
        counters = self.counters
        if counters.first_result is None:
            counters.first_result = time.monotonic()
        line, index = self.in_flight.pop(out.request_id)
        line.outs[index] = out
        if None in line.outs:
            return  # a line of several prompts is written when all are done
        rid, outs = line.rid, line.outs
        record = self.fmt.result(line.context, outs if len(outs) > 1 else outs[0])
        failed = next((o for o in outs if o.error is not None), None)
        if failed is not None and failed.retryable:
            record["retryable"] = True  # an engine failure: a resumed run retries it
            counters.retryable += 1
        self.write(record, line.digest)
        counters.tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)  # n > 1: all
        out = failed or outs[0]
        if out.error:
            counters.error(line.line_no, rid, out.error)
        else:
            counters.done += 1
        if self.shown < self.show:
            self.shown += 1
            shown_text = f"error: {out.error}" if out.error else repr(out.text)
            print(f"[raysample] {rid!r} ({out.finish_reason.value}): {shown_text}", flush=True)
        self.progress.advance()


@dataclass
class Parsed:
    """A line read and parsed, waiting to be submitted."""

    rid: Any
    context: Any
    prompt: Any
    params: SamplingParams
    digest: str
    size: int
    line_no: int


@dataclass
class InFlight:
    """A line whose request(s) the engine runs: several for a run-batch line with a list of prompts."""

    rid: Any
    context: Any
    digest: str
    outs: list[RequestOutput | None]
    line_no: int


def parts_of(prompt: Any) -> list[Any]:
    return list(prompt) if isinstance(prompt, PromptParts) else [prompt]


def part_ids(rid: Any, prompt: Any) -> list[str]:
    """Engine ids: the line's, and for several prompts ``<id>%p<i>`` (an escaped id has no bare ``%p``)."""
    base = engine_request_id(id_key(rid))
    if not isinstance(prompt, PromptParts):
        return [base]
    return [f"{base}%p{i}" for i in range(len(prompt))]

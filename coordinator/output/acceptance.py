"""Accepting a step's sampled tokens: the row state the next plan needs, and who finished.

Rows are accepted with array operations where they can be: one sampled token each
(with per-row checks only where a row asks for them: stop ids, stop strings,
logprobs), or several (verified drafts) for rows without such checks. Rows that
need per-token checks over several tokens run per-request code (``_accept``). All
three ask ``coordinator.output.finish_rule``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from coordinator.metrics import EngineMetrics
from coordinator.output.detokenizer import IncrementalDetokenizer
from coordinator.output.finish_rule import stop_strings_apply, token_finish
from coordinator.output.outputs import OutputBuilder
from coordinator.output.stop_bytes import StopScanner, complete_utf8, token_bytes
from coordinator.request import FinishReason, Request
from coordinator.schedule.scheduler import Scheduler
from coordinator.spec.draft_policy import DraftPolicy
from coordinator.spec.ngram_batch import BatchNgramDrafter
from workers.wire import EMPTY, StepPlan, StepResult, TokenLogprobs, offsets_of


class Acceptance:
    def __init__(self, tokenizer: Any, scheduler: Scheduler, metrics: EngineMetrics, outputs: OutputBuilder,
                 detokenizers: dict[str, IncrementalDetokenizer], finished_row: Callable[[Request], None],
                 drafts: BatchNgramDrafter | None = None, draft_policy: DraftPolicy | None = None) -> None:
        """``finished_row``: told of every row that finishes while its tokens are accepted."""
        self.scheduler = scheduler
        self.metrics = metrics
        self.outputs = outputs
        self.detokenizers = detokenizers
        self.finished_row = finished_row
        self.drafts = drafts
        self.draft_policy = draft_policy
        # Token id -> bytes, when the tokenizer decodes by concatenating them (coordinator.output.stop_bytes).
        self.token_bytes = token_bytes(tokenizer)
        self.complete_utf8 = complete_utf8(self.token_bytes) if self.token_bytes is not None else None
        self.last_tokens: np.ndarray = EMPTY  # accepted last step, flat, rows of the plan's layout
        self.last_counts: np.ndarray | None = None  # per row; None: one each

    def take_last(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The tokens accepted last step, for the next plan (each is sent once)."""
        last = self.last_tokens, self.last_counts
        self.last_tokens, self.last_counts = EMPTY, None
        return last

    def fast_paths(self, simple: np.ndarray, multi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows accepted with arrays: one token each (``simple``), several (``multi``); the rest run
        ``_accept``. Tests override this to run every row per request: the reference."""
        return simple, multi

    def accept(self, plan: StepPlan, results: Sequence[StepResult], slots: np.ndarray, plan_started: float) -> None:
        """Take the sampled tokens of ``plan``'s step and apply stop conditions: all the next plan
        needs. ``slots``: each row's slot in the plan. Building outputs can wait until the next
        step is sent.

        Rows are accepted with array operations: one sampled token each (with per-row checks
        only where a row asks for them: stop ids, stop strings, logprobs), or several (verified
        drafts) for rows without such checks. Only rows that finish and rows with several tokens
        and a per-token check run per-request code."""
        n = plan.batch_size
        if len(slots) != n:
            raise RuntimeError(f"step {plan.step}: results for a plan of {n} rows, {len(slots)} expected")
        self._observe(plan, results, plan_started)
        tokens, counts, logprobs = gather(plan, results)
        table = self.scheduler.table
        now = time.monotonic()
        generated_before = self.metrics.generated_tokens
        computed = plan.start + plan.num_tokens
        live = self._failed_and_scored(results, slots)
        samples = computed >= table.total[slots]
        chunk = live & ~samples  # a prefill chunk: its sample is not a token
        table.computed[slots[chunk]] = computed[chunk]
        simple = live & samples
        multi = np.zeros(n, dtype=bool)
        if counts is not None:
            checked = table.stop_ids[slots] | table.stop_text[slots] | table.wants_logprobs[slots]
            multi = simple & (counts > 1) & ~checked
            simple &= counts == 1
        simple, multi = self.fast_paths(simple, multi)
        if plan.draft_counts is not None:
            self._count_drafts(plan, slots, live & samples, counts)
        offsets = offsets_of(counts) if counts is not None else np.arange(n + 1)
        accepted_counts = np.zeros(n, dtype=np.int32)
        rows = np.flatnonzero(simple)
        token = self._accept_one_each(rows, slots, tokens[offsets[rows]].astype(np.int64), computed, logprobs, now)
        accepted_counts[rows] = 1
        multi_rows, multi_accepted = self._accept_several(np.flatnonzero(multi), slots, tokens, counts, offsets,
                                                          computed, now)
        accepted_counts[multi_rows] = multi_accepted
        per_row = self._accept_per_request(np.flatnonzero(live & samples & ~simple & ~multi), slots, tokens, offsets,
                                           computed, logprobs, now)
        for r, accepted in per_row.items():
            accepted_counts[r] = len(accepted)
        if not per_row and bool(simple.all()):
            self.last_tokens, self.last_counts = token.astype(np.int32), None
        else:
            self.last_tokens = _accepted_flat(accepted_counts, rows, token, multi_rows, multi_accepted, counts,
                                              tokens, offsets, per_row)
            self.last_counts = accepted_counts
        if self.drafts is not None:
            counts_now = self.last_counts if self.last_counts is not None else np.ones(n, dtype=np.int32)
            self.drafts.append(slots, counts_now, self.last_tokens)
        self.metrics.steps += 1
        self.metrics.generation_rate.add(self.metrics.generated_tokens - generated_before, now)

    def _observe(self, plan: StepPlan, results: Sequence[StepResult], plan_started: float) -> None:
        """The step's figures: what the draft policy learns from a decode step, the pipelined step's rows."""
        if self.draft_policy is not None and bool((plan.num_tokens == 1).all()):
            drafts = plan.draft_counts if plan.draft_counts is not None else EMPTY
            self.draft_policy.observe_step(plan.batch_size + int(drafts.sum()), int(drafts.max(initial=0)),
                                           time.perf_counter() - plan_started,
                                           max((r.timings.sample_pass_s for r in results), default=0.0))
        self.metrics.ahead_rows += sum(r.timings.ahead_rows for r in results)
        self.metrics.ahead_wasted_rows += sum(r.timings.wasted_rows for r in results)

    def _failed_and_scored(self, results: Sequence[StepResult], slots: np.ndarray) -> np.ndarray:
        """Prompt logprobs of the chunks computed kept by their requests (once per position); rows that could
        not be sampled fail their request, no one else's. Returns which rows are still live."""
        table = self.scheduler.table
        live = ~table.done[slots]
        for result in results:
            for row, (first, positions) in result.prompt_logprobs.items():
                group = table.requests[slots[row]].group
                if group is not None:
                    group.take_prompt_logprobs(first, positions)
        for result in results:
            for row, message in result.errors.items():
                if live[row]:
                    live[row] = False
                    request = table.requests[slots[row]]
                    request.finish(FinishReason.ERROR, error=message)
                    self.finished_row(request)
        return live

    def _accept_one_each(self, rows: np.ndarray, slots: np.ndarray, token: np.ndarray, computed: np.ndarray,
                         logprobs: dict, now: float) -> np.ndarray:
        """Rows ``rows`` sampled one ``token`` each: arrays, plus per-row checks only where a row asks for them
        (stop ids, logprobs, stop strings). Returns ``token``."""
        table = self.scheduler.table
        s = slots[rows]
        table.computed[s] = computed[rows]
        total = table.total[s] + 1
        table.total[s] = total
        deque(map(list.append, map(table.outputs.__getitem__, s.tolist()), token.tolist()), maxlen=0)
        self.metrics.generated_tokens += len(rows)
        length, eos, stop_ids_apply = token_finish(total, table.limit[s], table.min_total[s], token, table.eos[s])
        stop: dict[int, int | str] = {}  # index into rows -> stop reason (a token id or a string)
        pick = np.flatnonzero(table.stop_ids[s] & stop_ids_apply)
        for i, slot, tok in zip(pick.tolist(), s[pick].tolist(), token[pick].tolist()):
            if tok in table.requests[slot].params.stop_token_ids:
                stop[i] = tok
        pick = np.flatnonzero(table.wants_logprobs[s])
        for slot, row in zip(s[pick].tolist(), rows[pick].tolist()):
            lps = logprobs.get(row)
            if lps is not None:
                table.logprobs[slot].extend(lps)
        stop.update(self._stop_strings(s, token, total))
        for i in sorted({*np.flatnonzero(length | eos).tolist(), *stop}):
            request = table.requests[s[i]]
            reason = stop.get(i)
            if isinstance(reason, str):  # a stop string wins over length and EOS, and cuts the text
                request.finish(FinishReason.STOP, stop_reason=reason)
            else:
                request.finish(FinishReason.LENGTH if length[i] else FinishReason.STOP, stop_reason=reason)
                self.finalize_text(request)
            self.finished_row(request)
        for slot in s[total - table.prompt_len[s] == 1].tolist():
            table.requests[slot].first_token_time = now
        self.outputs.stream(map(table.requests.__getitem__, s[table.stream[s]].tolist()))
        return token

    def _stop_strings(self, s: np.ndarray, token: np.ndarray, total: np.ndarray) -> dict[int, str]:
        """Of slots ``s`` that took ``token``, those whose stop string it completes: index into ``s`` -> the string."""
        table = self.scheduler.table
        pick = np.flatnonzero(table.stop_text[s])
        checked = stop_strings_apply(total[pick], table.min_total[s[pick]])
        detokenizers, scanners, byte_table = table.detokenizers, table.stop_scanners, self.token_bytes
        complete = self.complete_utf8
        stop = {}
        for i, slot, tok, check in zip(pick.tolist(), s[pick].tolist(), token[pick].tolist(), checked.tolist()):
            scanner = scanners[slot]
            if scanner is None:
                found = detokenizers[slot].push_and_check(tok, check)
            else:
                if not scanner.dirty and complete[tok] and not scanner.may_stop(
                        byte_table, table.outputs[slot], len(byte_table[tok])):
                    continue  # no stop possible: decoding waits until the output is built
                found = self._exact_stop_check(table.requests[slot], detokenizers[slot], scanner)
            if found is not None:
                stop[i] = found
        return stop

    def _accept_per_request(self, rows: np.ndarray, slots: np.ndarray, tokens: np.ndarray, offsets: np.ndarray,
                            computed: np.ndarray, logprobs: dict, now: float) -> dict[int, list[int]]:
        """Rows that need per-request code (several tokens and a per-token check): row -> its accepted tokens."""
        table = self.scheduler.table
        per_row: dict[int, list[int]] = {}
        flat = tokens.tolist() if rows.size else []
        for r in rows.tolist():
            slot = int(slots[r])
            request = table.requests[slot]
            row_tokens = flat[offsets[r] : offsets[r + 1]]
            table.computed[slot] = computed[r] + len(row_tokens) - 1
            accepted = self._accept(request, row_tokens, logprobs.get(r))
            table.total[slot] = request.num_tokens
            scanner = table.stop_scanners[slot]
            if scanner is not None:
                detok = table.detokenizers[slot]
                scanner.dirty = detok.read_offset < len(detok.tokens)
            self.metrics.generated_tokens += len(accepted)
            if accepted and request.first_token_time is None:
                request.first_token_time = now
            per_row[r] = accepted
            if not request.group.final_only:
                self.outputs.due(request.group)
            if request.finished:
                self.finished_row(request)
        return per_row

    def _exact_stop_check(self, request: Request, detok: IncrementalDetokenizer, scanner: StopScanner) -> str | None:
        """Push the row's tokens the detokenizer has not seen, checking each as ``_accept`` would;
        only the newest may complete a stop string (the byte scan ruled out the others)."""
        output, prompt_len = request.output_token_ids, len(request.prompt_token_ids)
        min_total = int(self.scheduler.table.min_total[request.slot])
        found = None
        for j in range(detok.consumed, len(output)):
            hit = detok.push_and_check(output[j], bool(stop_strings_apply(prompt_len + j + 1, min_total)))
            if hit is not None:
                if j != len(output) - 1:
                    raise RuntimeError(f"request {request.request_id}: stop string {hit!r} completed by a token "
                                       "the byte scan passed over")
                found = hit
        scanner.dirty = detok.read_offset < len(detok.tokens)
        return found

    def _count_drafts(self, plan: StepPlan, slots: np.ndarray, sampled: np.ndarray, counts: np.ndarray | None) -> None:
        """Spec-decode metrics (and the adaptive policy's per-request acceptance) of rows that verified drafts."""
        drafted = sampled & (plan.draft_counts > 0)
        rows = np.flatnonzero(drafted)
        emitted = counts[rows] if counts is not None else np.ones(len(rows), np.int32)
        self.metrics.spec_proposed += int(plan.draft_counts[rows].sum())
        self.metrics.spec_accepted += int((emitted - 1).sum())
        if self.draft_policy is not None:
            table = self.scheduler.table
            for slot, proposed, got in zip(slots[rows].tolist(), plan.draft_counts[rows].tolist(), emitted.tolist()):
                self.draft_policy.observe(table.requests[slot].request_id, proposed, got - 1)

    def _accept_several(self, rows: np.ndarray, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray | None, offsets: np.ndarray,
                        computed: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows that sampled several tokens (verified drafts) and need no per-token check: each
        keeps its tokens up to the first that finishes it. Returns the rows and their accepted counts."""
        if rows.size == 0:
            return rows, rows
        table = self.scheduler.table
        s = slots[rows]
        c = counts[rows]
        starts = offsets[rows]
        local = offsets_of(c)[:-1]
        row_ix = np.repeat(np.arange(len(rows)), c)
        pos = np.arange(int(c.sum())) - local[row_ix]
        token = tokens[starts[row_ix] + pos].astype(np.int64)
        before = table.total[s]
        total_at = before[row_ix] + pos + 1
        length, eos, _ = token_finish(total_at, table.limit[s][row_ix], table.min_total[s][row_ix], token,
                                      table.eos[s][row_ix])
        finishes = length | eos
        first = np.minimum.reduceat(np.where(finishes, pos, len(pos)), local)
        accepted = np.where(first < c, first + 1, c)
        table.computed[s] = computed[rows] + c - 1
        table.total[s] = before + accepted
        flat = tokens.tolist()
        deque(map(list.extend, map(table.outputs.__getitem__, s.tolist()),
                  map(flat.__getitem__, map(slice, starts.tolist(), (starts + accepted).tolist()))), maxlen=0)
        self.metrics.generated_tokens += int(accepted.sum())
        for i in np.flatnonzero(first < c).tolist():
            request = table.requests[s[i]]
            request.finish(FinishReason.LENGTH if length[local[i] + first[i]] else FinishReason.STOP)
            self.finalize_text(request)
            self.finished_row(request)
        for slot in s[before == table.prompt_len[s]].tolist():
            table.requests[slot].first_token_time = now
        self.outputs.stream(map(table.requests.__getitem__, s[table.stream[s]].tolist()))
        return rows, accepted

    def _accept(self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> list[int]:
        """Append tokens in order until one finishes the request; later ones are dropped."""
        params = request.params
        detok = self.detokenizers[request.request_id]
        if detok.stop:  # tokens the byte scan let wait (none of them could complete a stop string)
            detok.catch_up(request.output_token_ids)
        table, slot = self.scheduler.table, request.slot
        limit, min_total, eos = table.limit[slot], table.min_total[slot], table.eos[slot]
        prompt_len = len(request.prompt_token_ids)
        accepted = []
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            accepted.append(token)
            if request.logprobs is not None and logprobs is not None:
                request.logprobs.append(logprobs[i])
            delta = detok.push(token) if detok.stop else ""  # no stop strings: decoded when output
            total = np.int64(prompt_len + len(request.output_token_ids))
            finish = token_finish(total, limit, min_total, token, eos)
            if finish.length:
                request.finish(FinishReason.LENGTH)
            elif finish.eos:
                request.finish(FinishReason.STOP)
            elif finish.stop_ids_apply and token in params.stop_token_ids:
                request.finish(FinishReason.STOP, stop_reason=token)
            if delta and stop_strings_apply(total, min_total):
                stop = detok.find_stop(len(delta))
                if stop is not None:
                    request.finish(FinishReason.STOP, stop_reason=stop)
                    break
            if request.finished:
                self.finalize_text(request)
                break
        return accepted

    def finalize_text(self, request: Request) -> None:
        """Emit text still held back for an incomplete character; it may complete a stop string."""
        detok = self.detokenizers.get(request.request_id)
        if detok is None or isinstance(request.stop_reason, str) or not detok.stop:
            return  # without stop strings nothing here depends on the text: it is decoded when output
        detok.catch_up(request.output_token_ids)
        delta = detok.flush()
        stop = detok.find_stop(len(delta)) if delta else None
        if stop is not None:
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop


def gather(plan: StepPlan, results: Sequence[StepResult]) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """Every worker's tokens in row order: flat tokens, per-row counts (None: one each), logprobs by row."""
    ordered = sorted(results, key=lambda r: r.rows[0])
    at = 0
    for result in ordered:
        lo, hi = result.rows
        if lo != at:
            raise RuntimeError(f"step {plan.step}: no worker returned rows {at}..{lo - 1}")
        at = hi
    if at != plan.batch_size:
        raise RuntimeError(f"step {plan.step}: no worker returned rows {at}..{plan.batch_size - 1}")
    tokens = np.concatenate([r.tokens for r in ordered]) if ordered else EMPTY
    counts = None
    if any(r.counts is not None for r in ordered):
        counts = np.concatenate([r.counts if r.counts is not None else np.ones(r.rows[1] - r.rows[0], np.int32)
                                 for r in ordered])
    logprobs: dict[int, Any] = {}
    for result in ordered:
        logprobs.update(result.logprobs)
    return tokens, counts, logprobs


def _accepted_flat(accepted_counts: np.ndarray, rows: np.ndarray, token: np.ndarray, multi_rows: np.ndarray,
                   multi_accepted: np.ndarray, counts: np.ndarray | None, tokens: np.ndarray, offsets: np.ndarray,
                   per_row: dict[int, list[int]]) -> np.ndarray:
    """Every row's accepted tokens, flat in row order (``accepted_counts[r]`` for row r): what the next plan
    sends to the workers."""
    out = np.zeros(int(accepted_counts.sum()), dtype=np.int32)
    at = offsets_of(accepted_counts)
    out[at[rows]] = token
    if multi_rows.size:
        c = counts[multi_rows]
        row_ix = np.repeat(np.arange(len(multi_rows)), c)
        pos = np.arange(int(c.sum())) - offsets_of(c)[:-1][row_ix]
        keep = pos < multi_accepted[row_ix]
        out[(at[multi_rows][row_ix] + pos)[keep]] = tokens[(offsets[multi_rows][row_ix] + pos)[keep]]
    for r, accepted in per_row.items():
        out[at[r] : at[r] + len(accepted)] = accepted
    return out

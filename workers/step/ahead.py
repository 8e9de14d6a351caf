"""The worker's half of the pipelined step: start step N+1's forward before its plan arrives.

Right after sampling step N a worker knows what most of its rows feed next: a decoding row
feeds the token it just sampled at the next position, into a block it already holds. It
launches that forward at once, on the process's compute thread (``workers.step.compute_thread``:
a GPU's stream, or the CPU cores the step loop leaves idle), and returns step N's tokens. A
row whose next token opens a new KV block writes it into a spare block (beyond the budget,
the runner's ``spare_blocks``), copied into the block the plan names once it arrives. While it runs, the coordinator accepts
step N and plans N+1, and the worker applies plan N+1 to its replicas; then the plan's rows
are matched against the guess, row by row (same request, position, token and blocks). Rows
that match take the logits already computed; the others (admitted, preempted, prefill
chunks, drafts) run in a second forward. A finished row's extra forward is simply not used:
it is never sampled, so processors see exactly the BatchUpdates and tokens of the
synchronous step.

A forward never overlaps another on the same KV cache: every forward runs on the compute
thread, one after another, the in-step one after the one launched ahead (even a discarded one).
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.row_work import RowWork
from workers.step.compute_thread import compute_thread


@dataclass
class ForwardDone:
    logits: torch.Tensor
    modelled_s: float  # a simulated runner's modelled compute (0 for a real model)
    device_cpu_s: float = 0.0  # of it, the CPU a simulated runner spent making the logits


@dataclass
class Guess:
    """The forward launched ahead: each guessed row's request id and work, in logits order."""

    request_ids: list[str]
    work: list[RowWork]
    future: Future
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {rid: i for i, rid in enumerate(self.request_ids)}


@dataclass
class Logits:
    """A step's logits (one row per sampled position, rows in the plan's order) and where they came from."""

    logits: torch.Tensor
    ahead_rows: int = 0  # rows whose logits the forward launched ahead computed
    wasted_rows: int = 0  # rows guessed but not in the plan as guessed (finished, preempted, moved away)
    ahead_s: float = 0.0  # a simulated runner's modelled compute of the forward launched ahead
    inline_s: float = 0.0  # and of the in-step forward
    inline_device_cpu_s: float = 0.0  # the CPU a simulated runner spent on the device's work in the latter


class Forwards:
    """Runs a worker's forwards on the compute thread; holds at most one launched ahead."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._guess: Guess | None = None
        self._launched: Future | None = None  # the last forward started on the thread
        self._spares = set(getattr(runner, "spare_blocks", ()))
        self.device = torch.device(getattr(runner, "device", "cpu"))

    def on_device(self) -> Any:
        """A context that makes the runner's GPU current (the compute thread serves every worker)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def _run(self, work: list[RowWork]) -> ForwardDone:
        modelled, device_cpu = getattr(self.runner, "simulated_s", 0.0), getattr(self.runner, "device_cpu_s", 0.0)
        with torch.inference_mode(), self.on_device():
            logits = self.runner.forward(work)
        return ForwardDone(logits, getattr(self.runner, "simulated_s", 0.0) - modelled,
                           getattr(self.runner, "device_cpu_s", 0.0) - device_cpu)

    def launch_ahead(self, request_ids: list[str], work: list[RowWork]) -> None:
        """Start the guessed next forward; returns at once."""
        self._guess = None
        if work:
            self._launched = compute_thread().submit(self._run, work)
            self._guess = Guess(request_ids, work, self._launched)

    def discard(self) -> None:
        """Forget the guess (a failed step, a reset); its forward still ends before the next one starts."""
        self._guess = None

    def _inline(self, work: list[RowWork]) -> ForwardDone:
        if self._launched is not None:
            try:
                self._launched.result()
            except Exception:  # a discarded guess's failure is nobody's
                pass
            self._launched = None
        return compute_thread().run(self._run, work)

    def forward(self, request_ids: list[str], work: list[RowWork]) -> Logits:
        """Logits for ``work`` (rows in order), from the guess where it matches."""
        guess, self._guess = self._guess, None
        if guess is None:
            done = self._inline(work)
            return Logits(done.logits, inline_s=done.modelled_s, inline_device_cpu_s=done.device_cpu_s)
        ahead = guess.future.result()
        self._launched = None
        taken = [guess.index.get(rid) for rid in request_ids]
        spares, targets = [], []
        for i, (at, row) in enumerate(zip(taken, work)):
            if at is None:
                continue
            guessed = guess.work[at]
            if not _same_work(guessed, row, self.spare_of(guessed)):
                taken[i] = None
            elif self.spare_of(guessed) is not None:
                spares.append(guessed.block_table[-1])
                targets.append(row.block_table[len(guessed.block_table) - 1])
        if spares:  # the plan named their blocks: move the tokens written into spares there
            compute_thread().run(self.runner.copy_blocks, spares, targets)
        used = sum(at is not None for at in taken)
        result = Logits(ahead.logits, ahead_rows=used, wasted_rows=len(guess.work) - used,
                        ahead_s=ahead.modelled_s)
        if used == len(work) == len(guess.work) and taken == list(range(used)):
            return result  # the plan is the guess, rows in the same order (one logit each)
        rest = [row for at, row in zip(taken, work) if at is None]
        inline = self._inline(rest) if rest else None
        parts, next_inline = [], 0
        for at, row in zip(taken, work):
            if at is not None:
                parts.append(ahead.logits[at : at + 1])
            else:
                parts.append(inline.logits[next_inline : next_inline + row.num_logits])
                next_inline += row.num_logits
        result.logits = torch.cat(parts) if parts else ahead.logits[:0]
        if inline is not None:
            result.inline_s, result.inline_device_cpu_s = inline.modelled_s, inline.device_cpu_s
        return result

    def spare_of(self, guessed: RowWork) -> int | None:
        """The spare block a guessed row's token went into, if it entered one."""
        last = guessed.block_table[-1] if guessed.block_table else None
        return last if last in self._spares else None

    def shutdown(self) -> None:
        self._guess = None


def _same_work(guessed: RowWork, planned: RowWork, spare: int | None) -> bool:
    """The planned row feeds what was guessed, where it was guessed, through the same blocks (a
    spare one standing for the block the plan gives it)."""
    if not (planned.start_pos == guessed.start_pos and planned.num_logits == 1 and planned.decode
            and planned.token_ids == guessed.token_ids and len(planned.block_table) >= len(guessed.block_table)):
        return False
    held = len(guessed.block_table) - (spare is not None)
    return planned.block_table[:held] == guessed.block_table[:held]


def guess_next(row_ids: list[str], work: list[RowWork], sampled: list[int], errors: set[int], block_size: int,
               max_model_len: int, spare_blocks: list[int] = ()) -> tuple[list[str], list[RowWork]]:
    """Each row that sampled a real token this step feeds it next, one position on: in a block it
    holds, or, for the first rows that need a new one, in a spare block.

    ``work``: this step's rows (shard order); ``sampled``: each row's sampled token, or -1 where the
    sample was no token (a prefill chunk); ``errors``: shard rows that could not be sampled."""
    ids, guessed = [], []
    spares = iter(spare_blocks)
    for i, (rid, row, token) in enumerate(zip(row_ids, work, sampled)):
        if token < 0 or i in errors or row.num_logits != 1:
            continue
        position = row.start_pos + len(row.token_ids)
        if position >= max_model_len:
            continue
        table = list(row.block_table)
        if position >= len(table) * block_size:
            spare = next(spares, None)
            if spare is None or position != len(table) * block_size:
                continue
            table.append(spare)
        ids.append(rid)
        guessed.append(RowWork(table, [token], position, num_logits=1, decode=True))
    return ids, guessed

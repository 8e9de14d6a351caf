"""A worker: mirror, processor replicas (the sampler) and the model for its own shard.

Every worker applies every plan to its mirror and sampler, so processor state
is identical everywhere; only the owner of a request keeps its KV cache, runs
the model for it and samples it. With ``launch_ahead`` (the pipelined step,
``scheduler.async_scheduling``) the forward of the next step starts as soon as
this one is sampled (``workers.step.ahead``), and applying the next plan overlaps it.

The model is loaded, run and sampled on the process's compute thread (``workers.step.compute_thread``);
the caller's thread applies plans.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from workers.host_cache import set_lock_timeout
from workers.model.lora import AdapterUnavailable
from workers.model.model_runner import ModelRunner
from workers.model.static_decode import decode_mode
from workers.model.tensor_parallel import Followers, LeadRunner
from workers.row_work import RowWork
from workers.sample.prompt_logprobs import prompt_logprobs
from workers.sample.rejection import verify_drafts
from workers.sample.sampler import Sampler
from workers.sample.sampler_errors import LogitsProcessorError
from workers.step.ahead import Forwards, Logits, guess_next
from workers.step.compute_thread import compute_thread
from workers.step.mirror import BatchMirror
from workers.step.worker_setup import WorkerSetup
from workers.wire import StepPlan, StepResult, StepTimings, offsets_of

# KV blocks beyond the budget for the pipelined step, one per row the worker holds up to this many:
# a guessed row entering a new block writes its token into one until the plan names its block
# (``workers.step.ahead``); rows past this many in one step wait for the plan.
MAX_SPARE_BLOCKS = 64


@dataclass
class ShardWork:
    """This worker's part of a plan: its rows as the runner takes them, their request ids, which of them sample
    a token (else a prefill chunk), and every row's drafts (None without)."""

    rows: list[RowWork]
    row_ids: list[str]
    samples: list[bool]
    drafts: list[list[int]] | None


class _Handoff:
    """The caller's word to the step's job that the plan is applied (sample) or failed to apply (stop)."""

    def __init__(self) -> None:
        self._event, self._ok = threading.Event(), False

    def ready(self) -> None:
        self._ok = True
        self._event.set()

    def cancel(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self) -> bool:
        self._event.wait()
        return self._ok


class Worker:
    def __init__(self, worker_id: int, runner: ModelRunner, sampler: Sampler,
                 make_sampler: Callable[[], Sampler] | None = None, launch_ahead: bool = False) -> None:
        """``launch_ahead``: start each next forward before its plan arrives (the pipelined step)."""
        self.worker_id = worker_id
        self.runner = runner
        self.sampler = sampler
        self.make_sampler = make_sampler
        self.mirror = BatchMirror()
        self.launch_ahead = launch_ahead
        self.forwards = Forwards(runner)

    def reset(self) -> None:
        """Forget the batch (after another worker failed, everything is re-added)."""
        if self.make_sampler is None:
            raise RuntimeError("this worker cannot rebuild its sampler")
        self.forwards.discard()
        self.sampler = compute_thread().run(self.make_sampler)
        self.mirror = BatchMirror()

    def shutdown(self) -> None:
        self.forwards.shutdown()

    def self_check(self) -> str | None:
        """Whether this worker's model still computes what it did at start-up (``ModelRunner.self_check``),
        asked when a failure hit every request it was given: None if it does (the requests are at fault),
        else why not (the engine is). A simulated runner, or a tensor-parallel group, answers None."""
        self.forwards.discard()
        check = None if isinstance(self.runner, LeadRunner) else getattr(self.runner, "self_check", None)
        return None if check is None else compute_thread().run(check)

    @classmethod
    def from_setup(cls, worker_id: int, setup: WorkerSetup, device: torch.device | str,
                   followers: Followers | None = None) -> Worker:
        """Build from the run's worker record (``cluster.engine.setup.worker_setup``). ``followers``: the other
        ranks of this worker's tensor-parallel group, which joined its process group with this one (the lead)."""
        runner = compute_thread().run(build_runner, setup, device)
        if followers is not None:
            runner = LeadRunner(runner, followers)
        reasoning = setup.sampler.reasoning
        tokenizer = None
        if reasoning is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(reasoning.tokenizer, trust_remote_code=reasoning.trust_remote_code)

        def make_sampler() -> Sampler:
            return build_sampler(setup, runner, tokenizer, device)

        return cls(worker_id, runner, compute_thread().run(make_sampler), make_sampler,
                   launch_ahead=pipelined(setup, device))

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepResult:
        try:
            return self._step(plan)
        except BaseException:
            self.forwards.discard()
            raise

    def _step(self, plan: StepPlan) -> StepResult:
        """The caller's thread applies the plan while the compute thread runs the step's one job (``_compute``):
        the processors' replicas take the plan's BatchUpdate while this shard's forward runs, since sampling is
        the first thing that reads them. A wave of admissions (every worker applies every row) then costs no
        more than the forward its own rows need."""
        start_time, start_cpu = time.perf_counter(), time.thread_time()
        self.mirror.append_tokens(plan.last_tokens, plan.last_counts)
        batch_update, _ = self.mirror.apply(plan.update)
        lo, hi = (int(x) for x in plan.shards[self.worker_id])
        work = self._work(plan, lo, hi)
        result = StepResult(worker_id=self.worker_id, step=plan.step, rows=(lo, hi))
        timings = result.timings
        overlap_cpu = time.thread_time() - start_cpu
        compute_cpu = 0.0
        if work.rows:
            updated = _Handoff()
            if compute_thread().is_current():  # nothing runs beside this thread: the update goes first
                self.sampler.update_state(batch_update)
                updated.ready()
            job = compute_thread().start(self._compute, result, work, updated, overlap_cpu)
            if not updated.is_set():
                update_start = time.thread_time()
                try:
                    self.sampler.update_state(batch_update)
                except BaseException:
                    updated.cancel()
                    _settle(job)  # it stops before sampling: its logits are nobody's
                    raise
                timings.update_cpu_s = time.thread_time() - update_start
                updated.ready()
            timings.plan_s = time.perf_counter() - start_time
            try:
                compute_cpu = job.result()
            except AdapterUnavailable as exc:  # only the requests with that adapter fail
                raise LogitsProcessorError(str(exc), tuple(lo + r for r in exc.rows)) from None
        else:
            self.sampler.update_state(batch_update)
            timings.plan_s = time.perf_counter() - start_time
        caller_cpu = time.thread_time()
        if plan.audit:
            result.row_digests = self.mirror.digests()
            result.processor_digests = self.sampler.state_digests()
        timings.compute_s = time.perf_counter() - start_time
        timings.cpu_s = overlap_cpu + timings.update_cpu_s + compute_cpu + time.thread_time() - caller_cpu
        return result

    def _compute(self, result: StepResult, work: ShardWork, updated: _Handoff, overlap_cpu: float) -> float:
        """The step's one job on the compute thread; returns its host CPU seconds. The plain step runs this
        step's forward and samples it. The pipelined step (``launch_ahead``) finds that forward already
        launched at the end of the last step (``Forwards.forward`` keeps the rows it guessed right), and
        launches the next one as soon as this one is sampled, before the next plan arrives."""
        start_cpu = time.thread_time()
        with torch.inference_mode(), self.forwards.on_device():
            got = self.forwards.forward(work.row_ids, work.rows)
        forward_cpu = time.thread_time() - start_cpu - got.inline_device_cpu_s  # a simulated device's is modelled
        self._note_forward(result.timings, got, overlap_cpu)
        if not updated.wait():
            return forward_cpu  # the plan failed to apply: nothing is sampled
        sample_cpu = self._sample(result, got, work)
        if self.launch_ahead and work.drafts is None:
            lo = result.rows[0]
            sampled = [t if s else -1 for t, s in zip(result.tokens.tolist(), work.samples)]
            errors = {row - lo for row in result.errors}
            self.forwards.launch_ahead(*guess_next(work.row_ids, work.rows, sampled, errors, self.runner.block_size,
                                                   self.runner.max_model_len, self.runner.spare_blocks))
        return forward_cpu + sample_cpu

    def _work(self, plan: StepPlan, lo: int, hi: int) -> ShardWork:
        """This shard's rows as the runner takes them (blocks the plan gives them included), their
        request ids, which of them sample a token, and every row's drafts (None without)."""
        rows = plan.block_rows
        mine = np.flatnonzero((rows >= lo) & (rows < hi))
        if mine.size:
            at = offsets_of(plan.block_counts)
            ids = plan.block_ids.tolist()
            for i in mine.tolist():
                self.mirror.row(int(rows[i])).block_table.extend(ids[at[i] : at[i + 1]])
        drafts = None
        if plan.draft_counts is not None:
            flat, offsets = plan.draft_tokens.tolist(), plan.draft_offsets.tolist()
            drafts = [flat[offsets[r] : offsets[r + 1]] for r in range(plan.batch_size)]
        work, row_ids, samples = [], [], []
        for index, start, count in zip(range(lo, hi), plan.start[lo:hi].tolist(), plan.num_tokens[lo:hi].tolist()):
            row = self.mirror.row(index)
            row_drafts = drafts[index] if drafts is not None else []
            length = len(row.prompt_token_ids) + len(row.output_token_ids)
            # A prompt chunk of a request asking for prompt logprobs: the logits of every position it computes.
            prompt_logits = row.params.prompt_logprobs is not None and start < len(row.prompt_token_ids)
            lora = row.params._lora
            work.append(RowWork(row.block_table, row.token_slice(start, start + count) + row_drafts, start,
                                num_logits=count if prompt_logits else len(row_drafts) + 1,
                                decode=count == 1 and start >= len(row.prompt_token_ids),
                                adapter=None if lora is None else (lora.lora_int_id, lora.lora_path)))
            row_ids.append(row.request_id)
            samples.append(start + count >= length)  # else a prefill chunk: its sample is no token
        return ShardWork(work, row_ids, samples, drafts)

    @staticmethod
    def _note_forward(timings: StepTimings, got: Logits, overlap_cpu: float) -> None:
        timings.ahead_rows, timings.wasted_rows = got.ahead_rows, got.wasted_rows
        timings.ahead_s, timings.simulated_s = got.ahead_s, got.ahead_s + got.inline_s
        if got.ahead_rows or got.wasted_rows:
            timings.overlap_cpu_s = overlap_cpu  # applying the plan ran while the forward did

    def _sample(self, result: StepResult, got: Logits, work: ShardWork) -> float:
        """``got``'s logits sampled into ``result``; returns the host CPU seconds it took."""
        start_cpu = time.thread_time()
        device_cpu = 0.0
        logits, drafts = got.logits, work.drafts
        lo, hi = result.rows
        with torch.inference_mode(), self.forwards.on_device():
            sample_start, sample_cpu = time.perf_counter(), time.thread_time()
            if drafts is None and self._prompt_rows(lo, work.rows):  # rows that gave every prompt position's logits
                logits = self._prompt_logprobs(result, logits, lo, work.rows)
            if drafts is None:
                out = self.sampler(logits, slice(lo, hi))
                result.tokens = out.sampled_token_ids.to("cpu", torch.int32).numpy()
                result.logprobs = {r: [lp] for r, lp in out.logprobs.items()}
                result.errors, result.model_faults = out.errors, out.model_faults
            else:
                verified = verify_drafts(self.sampler, logits, slice(lo, hi), drafts)
                result.counts = np.array([len(t) for t in verified.tokens], dtype=np.int32)
                result.tokens = np.array([t for row in verified.tokens for t in row], dtype=np.int32)
                result.logprobs = {lo + i: lp for i, lp in enumerate(verified.logprobs) if lp is not None}
                result.errors, result.model_faults = verified.errors, verified.model_faults
            passes = 1 + max((len(d) for d in drafts[lo:hi]), default=0) if drafts is not None else 1
            result.timings.sample_pass_s = (time.perf_counter() - sample_start) / passes
            wait_ready = getattr(self.runner, "wait_ready", None)
            if wait_ready is not None:  # a simulated device sampled within its modelled step: read when it ends
                device_cpu += time.thread_time() - sample_cpu
                wait_ready()
        return time.thread_time() - start_cpu - device_cpu

    def _prompt_rows(self, lo: int, work: list[RowWork]) -> bool:
        """Whether a row of this shard computes prompt tokens of a request that asks for their logprobs."""
        return any(w.start_pos < len(row.prompt_token_ids) and row.params.prompt_logprobs is not None
                   for row, w in ((self.mirror.row(lo + i), w) for i, w in enumerate(work)))

    def _prompt_logprobs(self, result: StepResult, logits: torch.Tensor, lo: int, work: list[RowWork]
                         ) -> torch.Tensor:
        """The prompt logprobs of the rows that gave a logit per position (``result.prompt_logprobs``); returns
        each row's last logit, the one it samples from."""
        counts = np.fromiter((w.num_logits for w in work), dtype=np.int64, count=len(work))
        ends = np.cumsum(counts)
        for i, w in enumerate(work):
            row = self.mirror.row(lo + i)
            prompt, start = row.prompt_token_ids, w.start_pos
            if row.params.prompt_logprobs is None or start >= len(prompt):
                continue
            # Position p's logits give the logprob of prompt token p + 1; the last prompt position's are the sample's.
            positions = min(int(counts[i]), len(prompt) - 1 - start)
            if positions > 0:
                rows = logits[int(ends[i] - counts[i]): int(ends[i] - counts[i]) + positions]
                targets = prompt[start + 1: start + 1 + positions]
                result.prompt_logprobs[lo + i] = (start + 1, prompt_logprobs(rows, targets, row.params.prompt_logprobs,
                                                                             self.sampler.logits_mode))
        return logits.index_select(0, torch.from_numpy(ends - 1).to(logits.device))


def _settle(future: Future) -> None:
    """Wait for ``future`` and drop its outcome."""
    try:
        future.result()
    except BaseException:  # noqa: BLE001 - the step fails with the error that stopped it first
        pass


def build_sampler(setup: WorkerSetup, runner: Any, tokenizer: Any, device: torch.device | str) -> Sampler:
    """The worker's sampler: its processors built for the runner's vocabulary and length."""
    from processors.builtins.thinking_budget import maybe_thinking_budget_holder

    spec = setup.sampler
    thinking = maybe_thinking_budget_holder(spec.reasoning, tokenizer, setup.max_num_seqs, device)
    model = replace(spec.engine_config.model_config, vocab_size=runner.vocab_size, max_model_len=runner.max_model_len)
    sampler = Sampler(replace(spec.engine_config, model_config=model), device, spec.custom_processors,
                      thinking=thinking, entry_points=spec.entry_points, grammar_cache_size=spec.grammar_cache_size)
    if spec.speculative:
        sampler.check_spec_decode_support()
    return sampler


def pipelined(setup: WorkerSetup, device: torch.device | str) -> bool:
    """Whether each next forward starts before its plan arrives (``scheduler.async_scheduling``)."""
    # Drafts come in the plan, so a step that verifies them cannot be guessed: with speculative
    # decoding every step waits for its plan (the synchronous step), as the docs say.
    ahead = setup.async_scheduling
    if ahead is None:
        # Not where steps replay CUDA graphs: a replay is a few launches, so there is little host
        # work to hide, and a guess that misses a row (an admission) costs a second replay; on an
        # H100 the synchronous step was faster (bench/RESULTS.md, "the step as CUDA graphs").
        graphs = decode_mode(setup.runner.enforce_eager, torch.device(device),
                             setup.runner.tensor_parallel_size) == "graphs"
        ahead = setup.simulated is not None or (torch.device(device).type != "cpu" and not graphs)
    return ahead and not setup.sampler.speculative


def build_runner(setup: WorkerSetup, device: torch.device | str) -> Any:
    """The model runner of a worker, or of one rank of its tensor-parallel group (every rank the same)."""
    set_lock_timeout(setup.lock_timeout_s)  # kernel builds and probes this process waits for
    spare = min(setup.slots_per_worker, MAX_SPARE_BLOCKS) if pipelined(setup, device) else 0
    if setup.simulated is not None:
        return simulated_runner(setup, device, spare)
    return ModelRunner.from_config(replace(setup.runner, spare_blocks=spare), device)


def simulated_runner(setup: WorkerSetup, device: torch.device | str, spare_blocks: int = 0) -> Any:
    """The config's ``model.simulate`` runner: the source model's vocabulary and length, no weights."""
    from workers.doubles.simulated_runner import SimulatedRunner

    runner, simulated = setup.runner, setup.simulated
    max_model_len = runner.max_model_len
    block_size = runner.block_size or 16
    blocks = simulated.num_blocks or setup.slots_per_worker * -(-max_model_len // block_size)
    return SimulatedRunner(simulated.compute, simulated.vocab_size, max_model_len, blocks, block_size, device,
                           spare_blocks=spare_blocks)

"""The sampler: every sampling feature is a ``LogitsProcessor`` on one BatchUpdate stream.

Order, as vLLM's ``Sampler`` (the project's design notes, "Sampler pipeline"; docs/architecture.md),
written once: ``before_greedy`` and ``after_greedy`` are the lists every pass follows.

1. raw logprobs of the rows that asked (from the logits as the model gave them)
2. float32
3. allowed token ids, bad words, structured outputs (the request's constraints)
4. non-argmax-invariant processors: min tokens, logit bias, custom ones
5. repetition / frequency / presence penalties, then slot-keyed processors
6. the thinking budget's forced tokens
7. greedy argmax
8. temperature                                        \
9. argmax-invariant processors: min-p, custom ones    |- skipped when the
10. top-k then top-p                                  |  whole batch is greedy
11. random sample (Gumbel-max, counter-based noise)   /

A call may cover only some rows (a worker's shard): stages with
``apply_rows`` see just those rows, any other processor sees a full-batch
view whose other rows are filler.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from processors import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    ProcessorSpec,
    SamplingParams,
    build_logitsprocs,
)
from processors.builtins.allowed_token_ids import AllowedTokenIdsLogitsProcessor
from processors.builtins.bad_words import BadWordsLogitsProcessor
from processors.builtins.grammar_processor import StructuredOutputLogitsProcessor
from processors.builtins.penalties import PenaltiesLogitsProcessor
from processors.builtins.temperature import TemperatureLogitsProcessor
from processors.builtins.thinking_budget import ThinkingBudgetStateHolder
from processors.builtins.top_k_top_p import TopKTopPLogitsProcessor
from processors.loading import CustomProcessor, load_custom_processors, split_by_interface
from processors.row_columns import RowColumns, upload
from processors.sampling_params import is_greedy
from workers.sample.counter_rng import gumbel_argmax, stream_base
from workers.sample.row_argmax import row_max_argmax
from workers.sample.pending_sample import PendingSample, SamplerOutput
from workers.sample.sampler_errors import (
    CONSTRAINTS_STAGE,
    MODEL_STAGE,
    BadRowTracker,
    LogitsProcessorError,
    check_logits,
    checked_apply,
    processor_name,
)
from workers.sample.slot_processors import SlotProcessorFailure, SlotProcessorHost
from workers.wire import TokenLogprobs


class Sampler:
    """Owns every sampling stage and feeds them the same BatchUpdate stream."""

    def __init__(
        self,
        config: Any,
        device: torch.device | str,
        custom_logitsprocs: Sequence[CustomProcessor] = (),
        is_pin_memory: bool = False,
        thinking: ThinkingBudgetStateHolder | None = None,
        entry_points: bool = True,
        grammar_cache_size: int = 256,
    ) -> None:
        self.device = torch.device(device)
        self.thinking = thinking
        model_config = getattr(config, "model_config", None)
        self.logits_mode = getattr(model_config, "logprobs_mode", "raw_logprobs") == "raw_logits"
        args = (config, self.device, is_pin_memory)
        self._constructor_args = args
        self.allowed_token_ids = AllowedTokenIdsLogitsProcessor(*args)
        self.bad_words = BadWordsLogitsProcessor(*args)
        reasoning = (thinking.start, thinking.end) if thinking is not None else None
        self.structured = StructuredOutputLogitsProcessor(*args, reasoning=reasoning, cache_size=grammar_cache_size)
        batch_level, slot_keyed = split_by_interface(load_custom_processors(custom_logitsprocs, entry_points))
        self._custom_kwargs = [(cls, kw) for cls, kw in batch_level]  # to rebuild one alone when it fails
        self.logitsprocs = build_logitsprocs(config, self.device, is_pin_memory, False,
                                             [ProcessorSpec(cls, kw) for cls, kw in batch_level], entry_points=False)
        self.slot_processors = SlotProcessorHost(config, self.device, slot_keyed)
        custom = tuple(cls for cls, _ in batch_level)
        # User code: the stages whose output is checked for NaN/inf (``BadRowTracker``).
        self._user_stages = {id(p) for p in self.logitsprocs.all if isinstance(p, custom)}
        self.penalties = PenaltiesLogitsProcessor(*args)
        self.temperature = TemperatureLogitsProcessor(*args)
        self.top_k_top_p = TopKTopPLogitsProcessor(*args)
        # No host read of a device value before the sampled ids (``sample``): on a GPU each such read stalls
        # the host until the device drains. On CPU, where nothing waits, shortcuts that read stay on.
        self.sync_free = self.device.type != "cpu"
        self.rows = RowColumns(
            config.scheduler_config.max_num_seqs,
            {
                "greedy": (np.bool_, True),
                "key": (np.int64, 0),
                "num_logprobs": (np.int64, -1),  # -1: not asked
                "prompt_len": (np.int64, 0),
                "output": (object, None),
                "params": (object, None),
                "prompt": (object, None),
            },
        )

    def before_greedy(self) -> list[LogitsProcessor]:
        """The stages that may change a row's argmax, in order; the greedy token is taken after them."""
        return [
            self.allowed_token_ids,
            self.bad_words,
            self.structured,
            *self.logitsprocs.non_argmax_invariant,
            self.penalties,  # the slot-keyed processors run right after (``_apply``)
            *([self.thinking] if self.thinking is not None else []),
        ]

    def after_greedy(self) -> list[LogitsProcessor]:
        """The stages only random rows need, in order: skipped when the whole batch is greedy."""
        return [self.temperature, *self.logitsprocs.argmax_invariant, self.top_k_top_p]

    @property
    def stages(self) -> list[LogitsProcessor]:
        """Every stage in pipeline order: the one list ``process``, ``update_state`` and the digests follow."""
        return self.before_greedy() + self.after_greedy()

    # ----- state -----

    @staticmethod
    def _row_values(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> dict[str, Any]:
        return {
            "greedy": is_greedy(params.temperature),
            "key": params.sampling_key,
            "num_logprobs": -1 if params.logprobs is None else params.logprobs,
            "prompt_len": len(prompt) if prompt is not None else 0,
            "output": output,
            "params": params,
            "prompt": prompt,
        }

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.rows.update(batch_update, self._row_values)
        if self.slot_processors:
            try:
                self.slot_processors.update_state(batch_update)
            except SlotProcessorFailure as failure:
                raise self._error(failure.processor, "add_request", failure.__cause__, failure.rows) from failure
        for stage in self.stages:
            try:
                stage.update_state(batch_update)
            except Exception as exc:
                raise self._error(stage, "update_state", exc) from exc

    # ----- speculative decoding (see LogitsProcessor's docstring for the contract) -----

    def _restored_under_drafts(self) -> list[LogitsProcessor]:
        return [p for p in self.logitsprocs.all if not getattr(p, "supports_spec_decode", False)]

    def check_spec_decode_support(self) -> None:
        """Refuse, at start-up, processors that speculative decoding would make drift."""
        for proc in self.logitsprocs.all:
            name = processor_name(proc)
            if getattr(proc, "incremental_state", False) and not getattr(proc, "supports_spec_decode", False):
                raise ValueError(
                    f"processor {name} declares incremental_state and not supports_spec_decode: it cannot stay "
                    "exact under speculative decoding; remove the speculative section or derive its state "
                    "from the output lists"
                )
        try:
            self.draft_snapshot()
        except Exception as exc:
            raise ValueError(f"speculative decoding needs a copy of each processor's state: {exc}") from None

    def draft_snapshot(self) -> list[tuple[LogitsProcessor, dict[str, Any]]]:
        """Each processor's state before drafts are appended; live output lists are shared, not copied."""
        memo_seed = {id(out): out for out in self.rows["output"] if out is not None}
        snapshots = []
        for proc in self._restored_under_drafts():
            memo = dict(memo_seed)
            for shared in getattr(proc, "spec_shared_objects", lambda: ())():
                memo[id(shared)] = shared
            try:
                snapshots.append((proc, copy.deepcopy(proc.__dict__, memo)))
            except Exception as exc:
                raise LogitsProcessorError(
                    f"Logits processor {processor_name(proc)} cannot be copied for speculative decoding: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return snapshots

    def draft_restore(self, snapshots: list[tuple[LogitsProcessor, dict[str, Any]]]) -> None:
        """Drafts removed: copied processors go back to their snapshot, the others get ``update_state(None)``."""
        for proc, state in snapshots:
            proc.__dict__.clear()
            proc.__dict__.update(state)
        restored = {id(p) for p, _ in snapshots}
        for stage in self.stages:
            if id(stage) not in restored:
                self._notify(stage)

    def drafts_appended(self) -> None:
        """Output lists grew by one draft position: ``update_state(None)`` for every stage."""
        for stage in self.stages:
            self._notify(stage)

    def _notify(self, stage: LogitsProcessor) -> None:
        try:
            stage.update_state(None)
        except Exception as exc:
            raise self._error(stage, "update_state", exc) from exc

    def _error(self, proc: object, where: str, exc: BaseException | None,
               failed: list[int] | None = None, logits: torch.Tensor | None = None,
               rows: slice | None = None) -> LogitsProcessorError:
        """The error to raise, with the rows whose requests make ``proc`` fail when those can be found.

        Known rows come from the processor (an adapter's failing callables, a slot-keyed
        processor); otherwise each request is replayed alone through a fresh instance of the
        processor (``culprit_rows``). Every replica finds the same rows: the replay reads only
        the full batch's state, never the shard.
        """
        failed = failed if failed is not None else getattr(exc, "rows", None)
        culprits = tuple(sorted(set(failed))) if failed else None
        if culprits is None and isinstance(proc, LogitsProcessor) and proc in self.stages:
            culprits = self.culprit_rows(proc, logits, rows)
        if culprits is None and isinstance(proc, AdapterLogitsProcessor):
            culprits = tuple(sorted(proc.req_info))
        return LogitsProcessorError(
            f"Logits processor {processor_name(proc)} raised in {where}: {type(exc).__name__}: {exc}", culprits or None
        )

    def _fresh_instance(self, proc: LogitsProcessor) -> LogitsProcessor:
        """A new instance built as ``proc`` was (same class, same kwargs)."""
        cls = type(proc)
        same_class = [p for p in self.logitsprocs.all if type(p) is cls]
        specs = [kw for c, kw in self._custom_kwargs if c is cls]
        kwargs = specs[same_class.index(proc)] if proc in same_class and len(specs) == len(same_class) else {}
        return cls(*self._constructor_args, **kwargs)

    def culprit_rows(self, proc: LogitsProcessor, logits: torch.Tensor | None = None,
                     rows: slice | None = None) -> tuple[int, ...] | None:
        """Rows whose request alone makes ``proc`` raise or return a bad tensor; ``None`` if none does.

        Each request is added, as row 0 of a batch of one, to a fresh instance, which then
        applies to a copy of that row's logits (zeros for rows outside this shard; the failed
        call may have changed them in place, which only matters to a processor whose failure
        depends on the values).
        """
        if proc not in self.logitsprocs.all:
            return None  # builtin stages are fed only validated parameters
        culprits = []
        for row in range(self.batch_size):
            params, prompt, output = self.rows["params"][row], self.rows["prompt"][row], self.rows["output"][row]
            if params is None:
                continue
            try:
                alone = self._fresh_instance(proc)
                alone.update_state(BatchUpdate(1, [], [(0, params, prompt, list(output))], []))
                if logits is None:  # it failed in update_state: the replay stops there too
                    continue
                if rows is not None and rows.start <= row < rows.stop:
                    one = logits[row - rows.start : row - rows.start + 1].clone()
                else:
                    one = logits.new_zeros(1, logits.shape[1])
                checked_apply(alone, one)
            except Exception:
                culprits.append(row)
        return tuple(culprits) if culprits else None

    @property
    def batch_size(self) -> int:
        return self.rows.batch_size

    def all_greedy(self) -> bool:
        return bool(self.rows["greedy"][: self.batch_size].all())

    def state_digests(self) -> dict[str, bytes]:
        """Per-stage digests (stages without ``state_digest`` are left out)."""
        out = {}
        for stage in self.stages:
            digest = getattr(stage, "state_digest", None)
            if digest is not None:
                out[processor_name(stage)] = digest()
        if self.slot_processors:
            out["slot-keyed processors"] = self.slot_processors.state_digest()
        return out

    @staticmethod
    def validate(params: SamplingParams, vocab_size: int) -> None:
        """Reject token ids the sampler would index out of range (called at admission)."""
        checks = {
            "logit_bias": list(params.logit_bias or ()),
            "allowed_token_ids": params.allowed_token_ids or [],
            "stop_token_ids": sorted(params.all_stop_token_ids),
            "bad_words": [t for seq in params.bad_words_token_ids or () for t in seq],
        }
        for name, ids in checks.items():
            bad = sorted({t for t in ids if not 0 <= t < vocab_size})
            if bad:
                raise ValueError(f"{name} has token id(s) {bad[:8]} outside the vocabulary [0, {vocab_size}).")

    # ----- sampling -----

    def _run(self, proc: LogitsProcessor, logits: torch.Tensor, rows: slice,
             tracker: BadRowTracker | None = None) -> torch.Tensor:
        try:
            apply_rows = getattr(proc, "apply_rows", None)
            if apply_rows is not None:
                shape, dtype, device = logits.shape, logits.dtype, logits.device
                out = check_logits(apply_rows(logits, rows), shape, dtype, device)
            elif rows.start == 0 and rows.stop == self.batch_size:
                out = checked_apply(proc, logits)
            else:
                # Full-batch view: the shard's rows are real, the others are filler.
                full = logits.new_zeros(self.batch_size, logits.shape[1])
                full[rows] = logits
                out = checked_apply(proc, full)[rows]
        except Exception as exc:
            raise self._error(proc, "apply", exc, logits=logits, rows=rows) from exc
        if tracker is not None and id(proc) in self._user_stages:
            tracker.check(processor_name(proc), out)
        return out

    def logprobs(self, raw: torch.Tensor, local: np.ndarray, rows: slice, sampled: torch.Tensor) -> dict[int, TokenLogprobs]:
        """Logprobs from raw logits ``raw`` (one row per entry of ``local``); ``sampled`` is per row of the call.
        With ``logprobs_mode`` raw_logits, the logits themselves (ranks and top tokens alike)."""
        logprobs = raw.float() if self.logits_mode else torch.log_softmax(raw.float(), dim=-1)  # (len(local), vocab)
        counts = self.rows["num_logprobs"][local + rows.start]
        n_max = int(counts.max())
        top = logprobs.topk(n_max, dim=-1) if n_max else None
        chosen = sampled[torch.from_numpy(local)].to(logprobs.device)  # the sampled ids, read on the host
        chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
        ranks = (logprobs >= chosen_lp).sum(dim=-1)
        out = {}
        for i, (row, n) in enumerate(zip(local + rows.start, counts)):
            out[int(row)] = TokenLogprobs(
                top_token_ids=top.indices[i, :n].tolist() if top is not None else [],
                top_logprobs=top.values[i, :n].tolist() if top is not None else [],
                sampled_token_id=int(chosen[i]),
                sampled_logprob=float(chosen_lp[i, 0]),
                sampled_rank=int(ranks[i]),
            )
        return out

    def process(self, logits: torch.Tensor, rows: slice, num_drafts: dict[int, int] | None = None,
                tracker: BadRowTracker | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run every stage; return (processed logits, greedy tokens, each row's maximum at the greedy point).

        Greedy tokens are the argmax after the argmax-changing stages and the
        thinking-budget forcing; the processed logits also went through
        temperature, argmax-invariant processors and top-k/top-p (unless the
        whole batch is greedy). The maximum is NaN, +inf or -inf exactly when
        that row cannot be sampled (it comes with the argmax: no extra pass).
        ``num_drafts``: rows whose output lists end with that many draft tokens
        (speculative decoding). ``tracker``: note which stage first made a row non-finite.
        """
        logits = logits.to(torch.float32)
        if tracker is not None:
            tracker.check(MODEL_STAGE, logits)
        for stage in self.before_greedy():
            logits = self._apply(stage, logits, rows, num_drafts, tracker)
        row_max, greedy_tokens = row_max_argmax(logits)
        if not self.all_greedy():
            # Condemned rows (no finite maximum) become zeros, so min-p or top-p cannot trip over them. On a
            # device in one pass, unread; on CPU only where some row is (the read costs nothing, the pass does).
            bad = ~torch.isfinite(row_max)
            if self.sync_free or bool(bad.any()):
                logits.masked_fill_(bad.unsqueeze(1), 0.0)
            for stage in self.after_greedy():
                logits = self._apply(stage, logits, rows, num_drafts, tracker)
        return logits, greedy_tokens, row_max

    def _apply(self, stage: LogitsProcessor, logits: torch.Tensor, rows: slice, num_drafts: dict[int, int] | None,
               tracker: BadRowTracker | None) -> torch.Tensor:
        """One stage of ``process``: the constraints are checked as a whole after structured outputs, the
        slot-keyed processors follow the penalties, the thinking budget sees the drafts."""
        if stage is self.thinking:
            return stage.apply_rows(logits, rows, num_drafts) if stage.has_tracked_requests() else logits
        if stage is not self.structured or self.structured.rows:
            logits = self._run(stage, logits, rows, tracker)
        if stage is self.structured and tracker is not None:
            tracker.check(CONSTRAINTS_STAGE, logits)
        if stage is self.penalties and self.slot_processors:
            logits = self._run_slot_processors(logits, rows, num_drafts)
            if tracker is not None:
                tracker.check("(slot-keyed processors)", logits)
        return logits

    def tracker(self) -> BadRowTracker | None:
        """A tracker when user processors run (they may return NaN); builtins only mask."""
        return BadRowTracker() if self._user_stages or self.slot_processors else None

    def _run_slot_processors(self, logits: torch.Tensor, rows: slice, num_drafts: dict[int, int] | None
                             ) -> torch.Tensor:
        try:
            return self.slot_processors.apply(logits, rows, num_drafts)
        except SlotProcessorFailure as failure:
            raise self._error(failure.processor, "apply", failure.__cause__, failure.rows) from failure

    def check_rows(self, logits: torch.Tensor, rows: slice | None) -> slice:
        rows = slice(0, logits.shape[0]) if rows is None else rows
        if rows.stop - rows.start != logits.shape[0] or rows.stop > self.batch_size:
            raise ValueError(
                f"logits hold {logits.shape[0]} rows but rows={rows} with batch size {self.batch_size}"
            )
        return rows

    def logprob_rows(self, rows: slice) -> np.ndarray:
        """Local indices of the rows in ``rows`` that asked for logprobs."""
        return np.flatnonzero(self.rows["num_logprobs"][rows.start : rows.stop] >= 0)

    def __call__(self, logits: torch.Tensor, rows: slice | None = None) -> SamplerOutput:
        """Sample one token per row of ``logits`` (persistent-batch rows ``rows``): ``sample``, then ``finish``.

        ``logits`` may be modified in place.
        """
        return self.sample(logits, rows).finish()

    def sample(self, logits: torch.Tensor, rows: slice | None = None) -> PendingSample:
        """Every stage and the draw, as device work: with ``sync_free`` no value is read on the host here, so
        the host returns at once and the first read is the sampled ids (``PendingSample.finish``)."""
        self.top_k_top_p.sync_free = self.sync_free
        rows = self.check_rows(logits, rows)
        logprob_local = self.logprob_rows(rows)
        raw = logits[upload(logprob_local, logits.device)] if logprob_local.size else None
        tracker = self.tracker()
        logits, sampled, row_max = self.process(logits, rows, tracker=tracker)
        random_local = np.flatnonzero(~self.rows["greedy"][rows.start : rows.stop])
        if random_local.size:
            index = upload(random_local, sampled.device)
            random_max = torch.empty(random_local.size, dtype=logits.dtype, device=logits.device)
            sampled[index] = self.sample_random(logits, random_local, rows, row_max=random_max)
            before = row_max[index]  # a row bad at the greedy point stays bad (it was zeroed since)
            row_max[index] = torch.where(torch.isfinite(before), random_max.to(row_max.dtype), before)
        return PendingSample(self, sampled, row_max, tracker, rows, raw, logprob_local)

    def positions(self, absolute_rows: np.ndarray) -> np.ndarray:
        """Absolute position of the token each row samples next: prompt + output so far."""
        outputs = self.rows["output"]
        return self.rows["prompt_len"][absolute_rows] + np.fromiter(
            (len(outputs[r]) for r in absolute_rows), dtype=np.int64, count=len(absolute_rows)
        )

    def random_base(self, absolute_rows: np.ndarray, salt: int = 0) -> torch.Tensor:
        """Counter-RNG state of each batch row at the position it samples next."""
        return stream_base(
            upload(self.rows["key"][absolute_rows], self.device),
            upload(self.positions(absolute_rows), self.device),
            salt,
        )

    def sample_rows(self, logits: torch.Tensor, absolute_rows: np.ndarray, salt: int = 0,
                    row_max: torch.Tensor | None = None) -> torch.Tensor:
        """One Gumbel-max sample per row of ``logits``, which belong to batch rows ``absolute_rows``
        (``row_max``: receives each row's maximum, see ``gumbel_argmax``)."""
        return gumbel_argmax(logits, self.random_base(absolute_rows, salt).to(logits.device), row_max=row_max,
                             dense=True if self.sync_free else None)

    def sample_random(self, logits: torch.Tensor, local: np.ndarray, rows: slice, salt: int = 0,
                      row_max: torch.Tensor | None = None) -> torch.Tensor:
        """Samples for rows ``local`` of a shard's ``logits`` (placement-independent)."""
        base = self.random_base(local + rows.start, salt).to(logits.device)
        every_row = local.size == logits.shape[0]  # local is sorted: then it is 0..n-1
        return gumbel_argmax(logits, base, None if every_row else upload(local, logits.device),
                             row_max=row_max, dense=True if self.sync_free else None)

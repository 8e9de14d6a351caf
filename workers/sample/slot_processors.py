"""Runs slot-keyed (vLLM Model Runner V2) processors on the same BatchUpdate stream as the rest.

Each request entering a row gets the lowest free slot (recycled when it leaves,
so a slot is always re-initialized through ``add_request``); moves change
which row holds a slot, never the slot. Committed tokens are copied into
``all_token_ids`` once per step, after the step's tokens joined the output
lists. Under speculative decoding the drafts appended to a row's output list
are not committed: a call at draft position ``j`` gives the processors the
request's rows ``0..j`` with the drafts in ``input_ids`` only, and keeps row ``j``.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
import torch

from processors import BatchUpdate, MoveDirectionality
from processors.adapter import final_rows
from processors.digest import digest_of
from processors.mrv2 import LogitsContext, LogitsProcessor, LogitsProcRequestState, SlotBuffer


class SlotProcessorFailure(RuntimeError):
    """A slot-keyed processor raised; ``rows``: the batch rows whose requests it was enabled for."""

    def __init__(self, processor: LogitsProcessor, rows: list[int]) -> None:
        super().__init__(f"{type(processor).__qualname__} failed")
        self.processor = processor
        self.rows = rows
        self.slot = -1


class SlotProcessorHost:
    def __init__(self, vllm_config: Any, device: torch.device, classes: list[tuple[type, dict[str, Any]]]) -> None:
        self.processors: list[LogitsProcessor] = []
        if not classes:
            return  # nothing to host: the sampler skips every call
        model = vllm_config.model_config
        max_reqs = vllm_config.scheduler_config.max_num_seqs
        self.device = device
        self.req_states = LogitsProcRequestState(
            device=device,
            max_num_reqs=max_reqs,
            vocab_size=model.vocab_size,
            all_token_ids=SlotBuffer((max_reqs, model.max_model_len), np.int64, device),
            prompt_len=SlotBuffer((max_reqs,), np.int64, device),
            prefill_len=SlotBuffer((max_reqs,), np.int64, device),
            total_len=SlotBuffer((max_reqs,), np.int64, device),
        )
        self.processors: list[LogitsProcessor] = [cls(vllm_config, self.req_states, **kw) for cls, kw in classes]
        self.enabled = np.zeros((len(self.processors), max_reqs), dtype=bool)
        self._free = list(range(max_reqs))
        self.slot_of_row: list[int] = []
        self._lists: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (prompt, live output)

    def __bool__(self) -> bool:
        return bool(self.processors)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch, then commit the tokens the output lists gained; once per step."""
        if batch_update is not None:
            rows = self.slot_of_row
            for index in batch_update.removed:
                self._release(rows[index])
                rows[index] = -1
            failures: list[tuple[int, SlotProcessorFailure]] = []
            for index, params, prompt, output in batch_update.added:
                while len(rows) <= index:
                    rows.append(-1)
                if rows[index] >= 0:
                    self._release(rows[index])
                try:
                    rows[index] = self._admit(params, list(prompt or []), output)
                except SlotProcessorFailure as failure:
                    rows[index] = failure.slot
                    failures.append((index, failure))
            for a, b, direction in batch_update.moved:
                if direction == MoveDirectionality.SWAP:
                    rows[a], rows[b] = rows[b], rows[a]
                else:
                    rows[b], rows[a] = rows[a], -1
            del rows[batch_update.batch_size :]
            if failures:
                failure = failures[0][1]
                failure.rows = final_rows([index for index, _ in failures], batch_update)
                raise failure
        self._commit()
        for buffer in (self.req_states.all_token_ids, self.req_states.prompt_len, self.req_states.prefill_len,
                       self.req_states.total_len):
            buffer.sync()
        for proc in self.processors:
            proc.apply_staged_writes()

    def _admit(self, params: Any, prompt: list[int], output: list[int]) -> int:
        slot = heapq.heappop(self._free)
        state = self.req_states
        tokens = prompt + list(output)
        state.all_token_ids.np[slot, : len(tokens)] = tokens
        state.prompt_len.np[slot] = len(prompt)
        state.prefill_len.np[slot] = len(tokens)
        state.total_len.np[slot] = len(tokens)
        self._lists[slot] = (prompt, output)
        for i, proc in enumerate(self.processors):
            try:
                self.enabled[i, slot] = bool(proc.add_request(slot, params))
            except Exception as exc:
                failure = SlotProcessorFailure(proc, [])
                failure.slot = slot
                failure.__cause__ = exc
                raise failure from exc
        return slot

    def rows_enabling(self, index: int) -> list[int]:
        """Batch rows whose requests processor ``index`` said it edits."""
        return [row for row, slot in enumerate(self.slot_of_row) if slot >= 0 and self.enabled[index, slot]]

    def _release(self, slot: int) -> None:
        if slot >= 0:
            self._lists.pop(slot, None)
            self.enabled[:, slot] = False
            heapq.heappush(self._free, slot)

    def _commit(self) -> None:
        state = self.req_states
        for slot, (prompt, output) in self._lists.items():
            done = int(state.total_len.np[slot])
            total = len(prompt) + len(output)
            if total > done:
                state.all_token_ids.np[slot, done:total] = output[done - len(prompt) :]
                state.total_len.np[slot] = total

    def apply(self, logits: torch.Tensor, rows: slice, num_drafts: dict[int, int] | None) -> torch.Tensor:
        """``logits``: one row per batch row of ``rows``; ``num_drafts``: drafts appended per row."""
        slots = np.array(self.slot_of_row[rows.start : rows.stop], dtype=np.int64)
        if not self.enabled[:, slots].any():
            return logits
        state = self.req_states
        drafts = np.array([(num_drafts or {}).get(r, 0) for r in range(rows.start, rows.stop)], dtype=np.int64)
        committed = state.total_len.np[slots]
        counts = drafts + 1
        row_of = np.repeat(np.arange(slots.size), counts)
        local = np.concatenate([np.arange(c) for c in counts])
        input_ids = np.empty(row_of.size, dtype=np.int64)
        offset = 0
        for i, (slot, count) in enumerate(zip(slots, counts)):
            input_ids[offset] = state.all_token_ids.np[slot, committed[i] - 1]
            if count > 1:
                input_ids[offset + 1 : offset + count] = self._lists[int(slot)][1][-(count - 1) :]
            offset += count
        device = logits.device
        ctx = LogitsContext(
            expanded_idx_mapping=torch.from_numpy(slots[row_of]).to(device),
            idx_mapping=torch.from_numpy(slots).to(device),
            idx_mapping_np=slots,
            expanded_local_pos=torch.from_numpy(local).to(device),
            input_ids=torch.from_numpy(input_ids).to(device),
            pos=torch.from_numpy(committed[row_of] - 1 + local).to(device),
            seq_lens_upper_bound_np=committed + drafts,
        )
        last = np.cumsum(counts) - 1  # each row's own position: the last of its expanded rows
        expanded = logits if drafts.max() == 0 else logits.index_select(0, torch.from_numpy(row_of).to(device))
        for i, proc in enumerate(self.processors):
            if self.enabled[i, slots].any():
                try:
                    expanded = proc.apply(expanded, ctx)
                except Exception as exc:
                    raise SlotProcessorFailure(proc, self.rows_enabling(i)) from exc
        return expanded if drafts.max() == 0 else expanded.index_select(0, torch.from_numpy(last).to(device))

    def state_digest(self) -> bytes:
        state = self.req_states
        return digest_of(self.slot_of_row, [(s, int(state.total_len.np[s])) for s in sorted(self._lists)],
                         self.enabled.tobytes())

"""Per-request state the step loop reads every step, as arrays indexed by a stable slot.

A running request holds one slot from admission until it leaves the batch; the persistent
batch maps rows to slots, so moves and swaps never touch these arrays. While a request holds
a slot, ``computed`` here is the truth for its KV progress (``Request.kv.num_computed`` is
written back with ``store`` before any per-request code reads it, and read again with
``load``). Everything else mirrors fields that change only at admission.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from coordinator.request import Request


class SlotTable:
    def __init__(self, capacity: int, max_model_len: int, block_size: int,
                 on_release: Callable[[int], None] | None = None) -> None:
        """``on_release``: called with a slot as it is freed (the n-gram drafter forgets the row)."""
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.requests: list[Request | None] = [None] * capacity
        self.outputs: list[list[int] | None] = [None] * capacity  # live output lists
        self.logprobs: list[list | None] = [None] * capacity  # live logprob lists (rows that asked)
        self.detokenizers: list = [None] * capacity  # the coordinator's, for rows with stop strings
        self.stop_scanners: list = [None] * capacity  # coordinator.output.stop_bytes.StopScanner, when the tokenizer allows
        self._free = list(range(capacity - 1, -1, -1))  # a stack: lowest slot first
        i64 = np.int64
        self.computed = np.zeros(capacity, i64)  # tokens whose KV is computed
        self.total = np.zeros(capacity, i64)  # prompt + output tokens
        self.prompt_len = np.zeros(capacity, i64)
        self.limit = np.zeros(capacity, i64)  # total tokens at which the request stops for length
        self.min_total = np.zeros(capacity, i64)  # EOS counts from this total on (min_tokens)
        self.eos = np.full(capacity, -1, i64)  # -1: none, or ignore_eos
        self.cap = np.zeros(capacity, i64)  # positions the block table covers
        self.registered = np.zeros(capacity, i64)  # full blocks published to the prefix index
        self.salted = np.zeros(capacity, bool)  # takes part in the prefix index
        self.owner = np.zeros(capacity, np.int32)
        self.arrival = np.zeros(capacity, i64)
        # Accepting a token needs a per-request check: stop token ids, stop strings (detokenized
        # on the critical path), logprobs to keep.
        self.stop_ids = np.zeros(capacity, bool)
        self.stop_text = np.zeros(capacity, bool)
        self.wants_logprobs = np.zeros(capacity, bool)
        self.stream = np.zeros(capacity, bool)  # an output per step
        self.done = np.zeros(capacity, bool)  # finished (or aborted) while still in the batch
        self.on_release = on_release

    def take(self, request: Request, salted: bool, detokenizer: object = None) -> int:
        """Give ``request`` a slot and fill it from the request (admission)."""
        slot = self._free.pop()
        request.slot = slot
        self.requests[slot] = request
        self.outputs[slot] = request.output_token_ids
        self.detokenizers[slot] = detokenizer
        params = request.params
        prompt = len(request.prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        self.prompt_len[slot] = prompt
        self.total[slot] = request.num_tokens
        self.limit[slot] = min(prompt + max_tokens, self.max_model_len)
        self.min_total[slot] = prompt + params.min_tokens
        eos = params.eos_token_id
        self.eos[slot] = -1 if params.ignore_eos or eos is None else eos
        self.salted[slot] = salted
        self.owner[slot] = request.owner
        self.arrival[slot] = request.arrival_seq
        self.stop_ids[slot] = bool(params.stop_token_ids)
        self.stop_text[slot] = bool(params.stop)
        self.wants_logprobs[slot] = request.logprobs is not None
        self.logprobs[slot] = request.logprobs
        self.stream[slot] = not request.group.final_only if request.group is not None else True
        self.done[slot] = False
        self.load(slot)
        return slot

    def load(self, slot: int) -> None:
        """Read the request's KV progress into the arrays (after per-request code changed it)."""
        request = self.requests[slot]
        kv = request.kv
        self.computed[slot] = kv.num_computed
        self.cap[slot] = len(kv.block_table) * self.block_size
        self.registered[slot] = kv.num_registered
        self.total[slot] = request.num_tokens

    def store(self, slot: int) -> None:
        """Write the arrays' KV progress back to the request (before per-request code reads it)."""
        request = self.requests[slot]
        if request.kv is not None:
            request.kv.num_computed = int(self.computed[slot])

    def prompt_progress(self, slots: np.ndarray, start: np.ndarray, count: np.ndarray) -> tuple[int, list[Request]]:
        """Rows ``slots`` fed ``count[i]`` tokens from ``start[i]`` this step: the tokens computed for a prompt (every
        token fed but a generating row's last one, its decode token: a recomputed prefix counts), and the first
        sibling of each request whose prompt this step completes."""
        total, prompt_len = self.total[slots], self.prompt_len[slots]
        decoding = (start + count == total) & (total > prompt_len)
        in_prompt = (start + 1 < total) | (start < prompt_len)
        ready = []
        for i in np.flatnonzero(in_prompt).tolist():
            request = self.requests[int(slots[i])]
            if request.child_index == 0 and start[i] + count[i] >= len(request.prompt_token_ids):
                ready.append(request)
        return int((count - decoding).sum()), ready

    def release(self, slot: int) -> None:
        request = self.requests[slot]
        if request is not None:
            self.store(slot)
            request.slot = None
        if self.on_release is not None:
            self.on_release(slot)
        self.requests[slot] = None
        self.outputs[slot] = None
        self.logprobs[slot] = None
        self.detokenizers[slot] = None
        self.stop_scanners[slot] = None
        self.done[slot] = False
        self._free.append(slot)

    def release_all(self) -> None:
        for slot, request in enumerate(self.requests):
            if request is not None:
                self.release(slot)
        self._free = list(range(self.capacity - 1, -1, -1))

"""A worker's copy of the persistent batch, kept identical on every worker.

It applies each step's ``PlanUpdate`` exactly as processors must (removes,
adds, moves) and hands processors a ``BatchUpdate`` whose output lists are
this worker's own, which grow by the tokens every plan carries. Applying a plan
costs O(rows that changed) in Python plus one C-level append over the rows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from processors import BatchUpdate, MoveDirectionality, SamplingParams
from processors.digest import digest_of
from workers.wire import PlanUpdate, offsets_of


@dataclass
class MirrorRow:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    owner: int
    block_table: list[int] = field(default_factory=list)  # the owner's KV blocks (coordinator-chosen)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop`` of prompt + output."""
        prompt = self.prompt_token_ids
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : stop - len(prompt)]
        return prompt[start:stop] + self.output_token_ids[: max(0, stop - len(prompt))]

    def digest(self) -> bytes:
        return digest_of(self.request_id, self.owner, self.prompt_token_ids, self.output_token_ids)


def _consume(iterator) -> None:
    deque(iterator, maxlen=0)


class BatchMirror:
    def __init__(self) -> None:
        self.rows: list[MirrorRow | None] = []
        self._outputs: list[list[int] | None] = []  # each row's output list, in row order

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> MirrorRow:
        row = self.rows[index]
        if row is None:
            raise IndexError(f"mirror row {index} is empty")
        return row

    def append_tokens(self, tokens: np.ndarray, counts: np.ndarray | None) -> None:
        """Append a step's accepted tokens (``StepPlan.last_tokens`` / ``last_counts``) to the rows' output lists."""
        if counts is None:
            if len(tokens) == 0:
                return
            if len(tokens) != len(self._outputs):
                raise ValueError(f"plan carries tokens for {len(tokens)} rows, the mirror has {len(self._outputs)}")
            _consume(map(list.append, self._outputs, tokens.tolist()))
            return
        if len(counts) != len(self._outputs):
            raise ValueError(f"plan carries tokens for {len(counts)} rows, the mirror has {len(self._outputs)}")
        ones = counts == 1
        flat = tokens.tolist()
        offsets = offsets_of(counts)
        one_rows = np.flatnonzero(ones)
        _consume(map(list.append, map(self._outputs.__getitem__, one_rows.tolist()),
                     map(flat.__getitem__, offsets[one_rows].tolist())))
        for r in np.flatnonzero(counts > 1).tolist():
            self._outputs[r].extend(flat[offsets[r] : offsets[r + 1]])

    def apply(self, update: PlanUpdate | None) -> tuple[BatchUpdate | None, list[str]]:
        """Apply removes, adds, moves; return the processors' BatchUpdate and the request ids that left."""
        if update is None:
            return None, []
        departed: list[str] = []
        rows, outs = self.rows, self._outputs
        for index in update.removed:
            departed.append(rows[index].request_id)
            rows[index] = outs[index] = None
        added = []
        for a in update.added:
            while len(rows) <= a.index:
                rows.append(None)
                outs.append(None)
            if rows[a.index] is not None:
                departed.append(rows[a.index].request_id)
            row = MirrorRow(a.request_id, a.params, list(a.prompt_token_ids), list(a.output_token_ids), a.owner)
            rows[a.index] = row
            outs[a.index] = row.output_token_ids
            added.append((a.index, row.params, row.prompt_token_ids, row.output_token_ids))
        for src, dst, direction in update.moved:
            if direction == MoveDirectionality.SWAP:
                rows[src], rows[dst] = rows[dst], rows[src]
                outs[src], outs[dst] = outs[dst], outs[src]
            else:
                if rows[dst] is not None:
                    departed.append(rows[dst].request_id)
                rows[dst], rows[src] = rows[src], None
                outs[dst], outs[src] = outs[src], None
        del rows[update.batch_size :]
        del outs[update.batch_size :]
        if None in outs:
            raise RuntimeError("mirror has an empty row inside the batch after an update")
        return BatchUpdate(update.batch_size, list(update.removed), added, list(update.moved)), departed

    def digests(self) -> list[bytes]:
        return [row.digest() for row in self.rows]

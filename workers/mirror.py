"""A worker's copy of the persistent batch, kept identical on every worker.

It applies each step's ``PlanUpdate`` exactly as processors must (removes,
adds, moves) and hands processors a ``BatchUpdate`` whose output lists are
this worker's own, which grow by the tokens every plan carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.plan import PlanUpdate
from processors import BatchUpdate, MoveDirectionality, SamplingParams
from processors.digest import digest_of


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


class BatchMirror:
    def __init__(self) -> None:
        self.rows: list[MirrorRow | None] = []

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> MirrorRow:
        row = self.rows[index]
        if row is None:
            raise IndexError(f"mirror row {index} is empty")
        return row

    def append_tokens(self, last_tokens: list[list[int]]) -> None:
        if last_tokens and len(last_tokens) != len(self.rows):
            raise ValueError(f"plan carries tokens for {len(last_tokens)} rows, the mirror has {len(self.rows)}")
        for row, tokens in zip(self.rows, last_tokens):
            if tokens:
                row.output_token_ids.extend(tokens)

    def apply(self, update: PlanUpdate | None) -> tuple[BatchUpdate | None, list[str]]:
        """Apply removes, adds, moves; return the processors' BatchUpdate and the request ids that left."""
        if update is None:
            return None, []
        departed: list[str] = []
        rows = self.rows
        for index in update.removed:
            departed.append(rows[index].request_id)
            rows[index] = None
        added = []
        for a in update.added:
            while len(rows) <= a.index:
                rows.append(None)
            if rows[a.index] is not None:
                departed.append(rows[a.index].request_id)
            row = MirrorRow(a.request_id, a.params, list(a.prompt_token_ids), list(a.output_token_ids), a.owner)
            rows[a.index] = row
            added.append((a.index, row.params, row.prompt_token_ids, row.output_token_ids))
        for src, dst, direction in update.moved:
            if direction == MoveDirectionality.SWAP:
                rows[src], rows[dst] = rows[dst], rows[src]
            else:
                if rows[dst] is not None:
                    departed.append(rows[dst].request_id)
                rows[dst], rows[src] = rows[src], None
        del rows[update.batch_size :]
        if any(r is None for r in rows):
            raise RuntimeError("mirror has an empty row inside the batch after an update")
        return BatchUpdate(update.batch_size, list(update.removed), added, list(update.moved)), departed

    def digests(self) -> list[bytes]:
        return [row.digest() for row in self.rows]

"""A processor that writes down everything it is shown, for the pipelined-step tests.

Each replica keeps its own log: every ``update_state`` (the BatchUpdate's removes, adds with
their output lists as they are then, moves) and, at every ``apply``, each row's output list.
The pipelined and the synchronous step must produce the same logs, replica for replica.
"""

from __future__ import annotations

from typing import Any

import torch

from processors import BatchUpdate, LogitsProcessor


class RecordingProcessor(LogitsProcessor):
    replicas: list[RecordingProcessor] = []  # every instance, in creation order

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.log: list[tuple] = []
        self.outputs: dict[int, list[int]] = {}  # row -> its output list, held by reference as vLLM's do
        RecordingProcessor.replicas.append(self)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            self.log.append(("update", None))
            return
        for index in batch_update.removed:
            self.outputs.pop(index, None)
        for index, _params, _prompt, output in batch_update.added:
            self.outputs[index] = output
        for a, b, direction in batch_update.moved:
            moved_a, moved_b = self.outputs.pop(a, None), self.outputs.pop(b, None)
            if moved_a is not None:
                self.outputs[b] = moved_a
            if moved_b is not None and str(direction).endswith("SWAP"):
                self.outputs[a] = moved_b
        self.log.append(("update", batch_update.batch_size, sorted(batch_update.removed),
                         [(i, list(out)) for i, _, _, out in batch_update.added],
                         [(a, b, str(d)) for a, b, d in batch_update.moved]))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.log.append(("apply", sorted((i, list(out)) for i, out in self.outputs.items())))
        return logits

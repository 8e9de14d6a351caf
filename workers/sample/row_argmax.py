"""Each row's maximum and the index of its first maximum, fast on CPU.

``torch.max(logits, dim=-1)`` on CPU runs a scalar reduction that tracks an index per element:
64 rows of a 49k vocabulary take ~2.5 ms on two cores, against ~0.1 ms for ``amax``. Here the
row is cut into blocks of 64: the block maxima come from ``amax`` (vectorized), the first block
holding the row's maximum from an ``argmax`` over those (1/64 of the data), and the index from an
``argmax`` inside that one block. The result is ``torch.max``'s, values and indices: the first
maximum, NaN winning as it does there. On a GPU ``torch.max`` is fast and one kernel; it is used as is.
"""

from __future__ import annotations

import torch

BLOCK = 64


def row_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's maximum, the index of its first maximum) of a 2-D tensor, as ``logits.max(dim=-1)``."""
    rows, width = logits.shape
    whole = width // BLOCK * BLOCK
    if logits.device.type != "cpu" or whole == 0:
        return logits.max(dim=-1)
    blocks = logits[:, :whole].reshape(rows, whole // BLOCK, BLOCK)
    block_max = blocks.amax(dim=-1)
    first_block = block_max.argmax(dim=-1)  # argmax takes NaN as the maximum, as max does
    inside = blocks[torch.arange(rows, device=logits.device), first_block].argmax(dim=-1)
    index = first_block * BLOCK + inside
    value = block_max.gather(1, first_block.unsqueeze(1)).squeeze(1)
    if whole < width:  # the tail after the last whole block: it wins only if strictly larger, or the first NaN
        tail_value, tail_index = logits[:, whole:].max(dim=-1)
        later = (tail_value > value) | (tail_value.isnan() & ~value.isnan())
        index = torch.where(later, tail_index + whole, index)
        value = torch.where(later, tail_value, value)
    return value, index

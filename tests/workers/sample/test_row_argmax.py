"""The blocked CPU row argmax gives exactly ``torch.max(dim=-1)``: values, and indices under ties, infinities and NaN."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.sample.row_argmax import BLOCK, row_max_argmax

# Few distinct values, so that ties, infinities and NaN land in every position: blocks, tails, both.
VALUES = [float("-inf"), -1.0, 0.0, 1.0, 2.0, float("inf"), float("nan")]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3 * BLOCK + 5), st.data())
def test_row_max_argmax_is_torch_max(rows: int, width: int, data: st.DataObject) -> None:
    cells = data.draw(st.lists(st.sampled_from(VALUES), min_size=rows * width, max_size=rows * width))
    logits = torch.tensor(cells, dtype=torch.float32).reshape(rows, width)
    value, index = row_max_argmax(logits)
    expected = logits.max(dim=-1)
    assert torch.equal(index, expected.indices)
    assert torch.equal(value.isnan(), expected.values.isnan())
    finite = ~expected.values.isnan()
    assert torch.equal(value[finite], expected.values[finite])


def test_row_max_argmax_on_a_vocabulary_of_random_logits() -> None:
    generator = torch.Generator().manual_seed(0)
    for width in (49152, 32001, 151936):
        logits = torch.randn(64, width, generator=generator)
        logits[3, 7] = logits[3].max()  # a tie: the first one wins
        logits[5, width - 1] = float("nan")  # NaN in the tail (or the last block)
        logits[9, 10:20] = float("-inf")
        value, index = row_max_argmax(logits)
        expected = logits.max(dim=-1)
        assert torch.equal(index, expected.indices)
        assert torch.equal(value.nan_to_num(), expected.values.nan_to_num())
        assert index[3] == 7 and value[5].isnan()

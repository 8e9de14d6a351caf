"""The Gumbel-max sample is the same token whichever way a row is processed.

On CPU peaked and filtered rows take a sparse shortcut (noise only for tokens that can win); on a
GPU every row goes through the dense pass in one launch sequence with no host sync. Both must give
the same token and the same row maximum for every row, or a seeded request's output would depend
on the device or on the rows beside it.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.sample.counter_rng import gumbel_argmax, stream_base


def _rows(data: st.DataObject, rows: int, vocab: int) -> torch.Tensor:
    seed = data.draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator)
    for r in range(rows):
        kind = data.draw(st.sampled_from(["flat", "peaked", "top_k", "few", "ties", "nan", "inf", "masked"]))
        if kind == "flat":
            logits[r] *= 0.01
        elif kind == "peaked":
            logits[r, data.draw(st.integers(0, vocab - 1))] += 40.0
        elif kind == "top_k":  # what top-k leaves: k finite tokens, the rest -inf
            k = data.draw(st.integers(1, vocab))
            cut = logits[r].topk(k).values[-1]
            logits[r] = logits[r].masked_fill(logits[r] < cut, float("-inf"))
        elif kind == "few":  # two tokens, far apart in value: only one can win
            logits[r] = float("-inf")
            logits[r, 0], logits[r, vocab - 1] = 0.0, 30.0
        elif kind == "ties":  # equal values everywhere: the noise decides, the lowest id among equal scores
            logits[r] = 1.0
        elif kind == "nan":
            logits[r, data.draw(st.integers(0, vocab - 1))] = float("nan")
        elif kind == "inf":
            logits[r, data.draw(st.integers(0, vocab - 1))] = float("inf")
        else:
            logits[r] = float("-inf")
    return logits


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9), st.sampled_from([1, 7, 64, 300, 2053]), st.data())
def test_dense_pass_gives_the_sparse_shortcuts_tokens(rows: int, vocab: int, data: st.DataObject) -> None:
    logits = _rows(data, rows, vocab)
    keys = torch.tensor(data.draw(st.lists(st.integers(-(2**62), 2**62), min_size=rows, max_size=rows)))
    positions = torch.tensor(data.draw(st.lists(st.integers(0, 4096), min_size=rows, max_size=rows)))
    base = stream_base(keys, positions)
    max_sparse, max_dense = torch.empty(rows), torch.empty(rows)
    sparse = gumbel_argmax(logits.clone(), base, row_max=max_sparse, dense=False)
    dense = gumbel_argmax(logits.clone(), base, row_max=max_dense, dense=True)
    assert torch.equal(sparse, dense)
    assert torch.equal(max_sparse.nan_to_num(), max_dense.nan_to_num())
    assert torch.equal(max_sparse.isnan(), max_dense.isnan())


def test_dense_pass_on_a_vocabulary_after_top_k_and_top_p() -> None:
    """A batch as the sampler sees it (49k vocabulary, most rows cut to a few candidates), with a
    subset of rows picked by index as ``Sampler.sample_random`` passes them."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49152, generator=generator) * 3
    for r in range(0, 64, 2):
        cut = logits[r].topk(50).values[-1]
        logits[r] = logits[r].masked_fill(logits[r] < cut, float("-inf"))
    picked = torch.tensor([0, 1, 5, 8, 13, 40, 63])
    base = stream_base(torch.arange(7) * 977 - 3, torch.arange(7) + 100)
    sparse = gumbel_argmax(logits, base, picked, dense=False)
    dense = gumbel_argmax(logits, base, picked, dense=True)
    assert torch.equal(sparse, dense)

"""The GPU's paged attention (FlexAttention over the pool's tiles, workers/model/flex_paged.py) against a
reference that gathers each row's keys and attends eagerly: random layouts with GQA, scattered and
prefix-shared blocks, mixed lengths, prompt chunks longer than a query tile, padding rows and queries,
sliding windows, soft-capping and sinks. On CPU torch runs FlexAttention's dense reference; on CUDA the
same layout goes to its compiled kernel."""

from __future__ import annotations

import random

import pytest
import torch

from workers.model.flex_paged import flex_layout, flex_paged_attention


def reference(q, k_pool, v_pool, tables, query_pos, scale, softcap, window, sinks):
    """Row by row: gather the row's keys in table order, mask by position, softmax (with the sink), values."""
    rows, heads, q_len, dim = q.shape
    kv = k_pool.shape[1]
    out = torch.zeros(rows, heads, q_len, dim, dtype=torch.float64)
    for r in range(rows):
        keys = k_pool[tables[r]].permute(1, 0, 2, 3).reshape(kv, -1, dim).double()  # (kv, width*bs, d)
        values = v_pool[tables[r]].permute(1, 0, 2, 3).reshape(kv, -1, dim).double()
        positions = torch.arange(keys.shape[1])
        for i in range(q_len):
            pos = int(query_pos[r, i])
            if pos < 0:
                continue
            allowed = positions <= pos
            if window is not None:
                allowed &= positions > pos - window
            for h in range(heads):
                g = h // (heads // kv)
                scores = (keys[g] @ q[r, h, i].double()) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                scores = scores.masked_fill(~allowed, float("-inf"))
                if sinks is not None:
                    probs = torch.softmax(torch.cat([scores, sinks[h].double().view(1)]), dim=0)[:-1]
                else:
                    probs = torch.softmax(scores, dim=0)
                out[r, h, i] = probs @ values[g]
    return out


def random_layout(rng: random.Random, rows: int, bs: int, pool_blocks: int, q_len: int):
    """Rows with lengths of 1..5 blocks, blocks scattered over the pool, rows 0 and 1 sharing a prefix
    block, and a padding row; each row's queries end at its length (a chunk or a decode token)."""
    free = list(range(pool_blocks))
    rng.shuffle(free)
    shared = free.pop()
    width = 5
    tables, query_pos = [], []
    for r in range(rows):
        length = rng.randint(q_len, width * bs)
        needed = -(-length // bs)
        table = [free.pop() for _ in range(needed)]
        if r < 2 and needed > 1:
            table[0] = shared  # the same prompt's first block, at the same index in both tables
        tables.append(table + [table[-1]] * (width - needed))  # padding entries past the row's last block
        real = min(q_len, rng.randint(1, q_len))
        query_pos.append([-1] * (q_len - real) + list(range(length - real, length)))
    tables.append([free.pop()] * width)  # a padding row: every query masked
    query_pos.append([-1] * q_len)
    return torch.tensor(tables), torch.tensor(query_pos)


@pytest.mark.parametrize(("q_len", "window", "softcap", "sinks"), [
    (1, None, None, False), (1, 9, None, False), (3, None, 30.0, False), (1, None, None, True),
    (150, None, None, False), (150, 20, 5.0, True),
])
def test_flex_paged_attention_equals_the_reference_on_random_layouts(q_len, window, softcap, sinks):
    rng = random.Random(q_len * 7 + (window or 0))
    heads, kv, dim, bs, pool_blocks = 8, 2, 16, 16 if q_len < 100 else 64, 40
    torch.manual_seed(0)
    k_pool = torch.randn(pool_blocks, kv, bs, dim)
    v_pool = torch.randn(pool_blocks, kv, bs, dim)
    tables, query_pos = random_layout(rng, 4, bs, pool_blocks, q_len)
    q = torch.randn(tables.shape[0], heads, q_len, dim)
    sink = torch.randn(heads) if sinks else None
    layout = flex_layout(tables, query_pos, pool_blocks, kv, heads, bs)
    got = flex_paged_attention(q, k_pool, v_pool, layout, dim ** -0.5, softcap, window, sink)
    want = reference(q, k_pool, v_pool, tables, query_pos, dim ** -0.5, softcap, window, sink)
    assert got.shape == q.shape
    assert torch.allclose(got.double(), want, atol=2e-5), float((got.double() - want).abs().max())
    padding = query_pos < 0
    assert not got.permute(0, 2, 1, 3)[padding].any()  # a padding query gives zeros

"""Decode attention (block-major torch path and the native CPU kernel) against a plain per-row
reference, over random pool layouts."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.cpu import native_attention, native_build
from workers.cpu.native_attention import paged_decode
from workers.model.decode_layout import MIN_GAP, block_major_layout, choose_segments
from workers.model.runner_options import use_native_decode
from workers.model.paged_attention import _block_major_decode

KV_HEADS, GROUPS, DIM = 2, 2, 8


def reference(q, k_pool, v_pool, tables, positions, block_size, scaling, window, softcap, sinks, rounded=False):
    """Eager attention per row and query over the row's blocks, concatenated: (rows, kv, q_len * g, d).

    ``rounded``: scores and probabilities rounded to bfloat16 where eager attention's bfloat16
    matmuls round them (as the kernel does with a bfloat16 cache); else exact, in float64.
    """
    def round_bf16(x):
        return x.to(torch.bfloat16).double() if rounded else x

    DIM = k_pool.shape[-1]  # noqa: N806
    rows, q_len = len(tables), max(len(p) for p in positions)
    out = torch.zeros(rows, KV_HEADS, q_len * GROUPS, DIM, dtype=torch.float64)
    for r, (table, pos) in enumerate(zip(tables, positions)):
        keys = k_pool[table].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM).double()
        values = v_pool[table].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM).double()
        key_pos = torch.arange(keys.shape[1])
        for i, p in enumerate(pos):
            query = q[r].view(KV_HEADS, q_len, GROUPS, DIM)[:, i].double()  # (kv, g, d)
            scores = round_bf16(torch.einsum("hgd,hld->hgl", query, keys)) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            allowed = key_pos <= p
            if window is not None:
                allowed &= key_pos > p - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                sink = sinks.double().view(KV_HEADS, GROUPS, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            probs = round_bf16(probs)
            out[r].view(KV_HEADS, q_len, GROUPS, DIM)[:, i] = torch.einsum("hgl,hld->hgd", probs, values)
    return out


@st.composite
def layouts(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 32]))  # 32: a block of more than one 16-key chunk
    num_blocks = draw(st.integers(4, 48))
    free = list(draw(st.permutations(range(num_blocks))))
    q_len = draw(st.integers(1, 3))
    tables, positions = [], []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(q_len, 5 * block_size))
        needed = -(-length // block_size)
        table = []
        if tables and draw(st.booleans()):  # a shared prefix: full blocks of an earlier row
            donor = draw(st.sampled_from(tables))
            table = donor[: min(len(donor) - 1, needed - 1)] if len(donor) > 1 else []
        if needed - len(table) > len(free):
            break
        table += [free.pop() for _ in range(needed - len(table))]
        tables.append(table)
        n = draw(st.integers(1, q_len))
        positions.append(list(range(length - n, length)))
    if not tables:
        tables, positions = [[free.pop()]], [[0]]
    return block_size, num_blocks, tables, positions


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from([None, 2, 5]), st.sampled_from([None, 3.0]), st.booleans(), st.integers(0, 2**16))
def test_block_major_decode_matches_per_row_attention(layout, window, softcap, with_sinks, seed):
    block_size, num_blocks, tables, positions = layout
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks, KV_HEADS, block_size, DIM, generator=gen)
    v_pool = torch.randn(num_blocks, KV_HEADS, block_size, DIM, generator=gen)
    offsets = np.cumsum([0] + [len(p) for p in positions])[:-1].tolist()
    dec = block_major_layout(tables, positions, offsets, block_size, num_blocks, torch.device("cpu"))
    q_len = dec.q_len
    q = torch.randn(len(tables), KV_HEADS, q_len * GROUPS, DIM, generator=gen)
    sinks = torch.randn(KV_HEADS * GROUPS, generator=gen) if with_sinks else None
    got = _block_major_decode(dec, q, k_pool, v_pool, dec.mask(window), 0.5, softcap, sinks)
    want = reference(q, k_pool, v_pool, tables, positions, block_size, 0.5, window, softcap, sinks)
    for r, pos in enumerate(positions):  # padding queries of short rows are not outputs
        real = got[r].view(KV_HEADS, q_len, GROUPS, DIM)[:, : len(pos)]
        torch.testing.assert_close(real.double(), want[r].view(KV_HEADS, q_len, GROUPS, DIM)[:, : len(pos)],
                                   rtol=1e-5, atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.sampled_from([None, 2, 5]), st.sampled_from([None, 3.0]), st.booleans(),
       st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([torch.float32, torch.bfloat16]),
       st.sampled_from([DIM, 16, 32, 64]), st.integers(0, 2**16))
def test_native_kernel_matches_per_row_attention(layout, window, softcap, with_sinks, dtype, q_dtype, dim, seed):
    """The C++ kernel reads each row's blocks through its table, queries packed as in a real step.

    ``dtype``: the pools'; ``q_dtype``: the queries' and the output's (the model's). On an AVX-512
    CPU, head dims that are a multiple of 16 take the kernel's register-tiled path (up to 6 query
    slots here: two tiles), head dim 8 its plain loops; elsewhere every head dim takes the plain loops.
    With AVX512-BF16, bfloat16 queries and pools with head dims 32 and 64 take its dot-product path.
    """
    DIM = dim  # noqa: N806
    block_size, num_blocks, tables, positions = layout
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks, KV_HEADS, block_size, DIM, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, KV_HEADS, block_size, DIM, generator=gen).to(dtype)
    sinks = torch.randn(KV_HEADS * GROUPS, generator=gen) if with_sinks else None
    rows, q_len = len(tables), max(len(p) for p in positions)
    n_tokens = sum(len(p) for p in positions) + 2  # two packed tokens of other rows (a prefill) stay untouched
    q_all = torch.randn(n_tokens, KV_HEADS * GROUPS, DIM, generator=gen).to(q_dtype)
    order = torch.randperm(n_tokens - 2, generator=gen).tolist()  # rows' tokens anywhere in the step
    token_index = torch.zeros(rows, q_len, dtype=torch.long)
    query_pos = torch.full((rows, q_len), -1, dtype=torch.long)
    block_tables = torch.zeros(rows, max(len(t) for t in tables), dtype=torch.long)
    q_ref = torch.zeros(rows, KV_HEADS, q_len * GROUPS, DIM)
    for r, (table, pos) in enumerate(zip(tables, positions)):
        block_tables[r, : len(table)] = torch.tensor(table)
        for i, p in enumerate(pos):
            token_index[r, i] = order.pop()
            query_pos[r, i] = p
            query = q_all[token_index[r, i]].view(KV_HEADS, GROUPS, DIM)
            q_ref[r].view(KV_HEADS, q_len, GROUPS, DIM)[:, i] = query.float()
    out = torch.full_like(q_all, 7.0)
    paged_decode(q_all, out, k_pool, v_pool, block_tables, token_index, query_pos, 0.5, softcap, window, sinks)
    want = reference(q_ref, k_pool.float(), v_pool.float(), tables, positions, block_size, 0.5, window, softcap, sinks,
                     rounded=dtype == torch.bfloat16)
    tolerance = 1e-5 if dtype == q_dtype == torch.float32 else 3e-2
    for r, pos in enumerate(positions):
        for i in range(len(pos)):
            got = out[token_index[r, i]].view(KV_HEADS, GROUPS, DIM)
            expected = want[r].view(KV_HEADS, q_len, GROUPS, DIM)[:, i]
            torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    assert (out[-2:] == 7.0).all()
    bf16_dot = dtype == q_dtype == torch.bfloat16 and dim % 32 == 0 and native_attention.bf16_dot_product()
    if q_dtype == torch.bfloat16 and not bf16_dot:  # the same sums as a float32 output, rounded once as torch rounds
        wide = torch.full(out.shape, 7.0)
        paged_decode(q_all.float(), wide, k_pool, v_pool, block_tables, token_index, query_pos, 0.5, softcap, window,
                     sinks)
        assert torch.equal(out, wide.to(torch.bfloat16))


def test_native_decode_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="CPU with float32 or bfloat16"):
        use_native_decode("native", torch.device("cpu"), torch.float16)
    with pytest.raises(ValueError, match="CPU with float32 or bfloat16"):
        use_native_decode("native", torch.device("cuda"), torch.float32)
    assert not use_native_decode("auto", torch.device("cuda"), torch.bfloat16)
    assert not use_native_decode("torch", torch.device("cpu"), torch.float32)
    assert use_native_decode("native", torch.device("cpu"), torch.float32)  # built by make setup, or here


def test_loading_the_kernel_keeps_subnormal_floats():
    """A library built with -ffast-math would switch on flush-to-zero for the whole process."""
    native_attention.load()
    assert sys.float_info.min / 2 > 0.0
    assert float(torch.tensor(sys.float_info.min, dtype=torch.float64) / 2) > 0.0


def test_a_worker_without_a_build_compiles_one_on_first_use_and_a_second_starting_with_it_waits(tmp_path, monkeypatch):
    """Two workers that start together (here this process and a child) compile the kernel once: the
    compiler, wrapped to log its runs, runs one time, and both load the same build. Where the host's
    cache holds the build of this very source, flags and CPU (``make setup`` makes it), the wrapper
    copies that to its ``-o`` instead of spending 9 CPU-s on g++ again; else it compiles."""
    kernels, calls = tmp_path / "kernels", tmp_path / "compiler-runs"
    host_build = shlex.quote(str(native_attention.library_path()))  # before RAYSAMPLE_KERNEL_DIR points here
    compiler = tmp_path / "logging-g++"
    compiler.write_text(f"""#!/bin/sh
echo run >> {shlex.quote(str(calls))}
sleep 1
out=; previous=
for argument in "$@"; do [ "$previous" = -o ] && out=$argument; previous=$argument; done
[ -f {host_build} ] && [ -n "$out" ] && exec cp {host_build} "$out"
exec {shlex.quote(shutil.which('g++') or 'g++')} "$@"
""")
    compiler.chmod(0o755)
    monkeypatch.setenv("RAYSAMPLE_KERNEL_DIR", str(kernels))
    monkeypatch.setenv("CXX", str(compiler))
    other = subprocess.Popen([sys.executable, "-c", "from workers.cpu import native_attention; print(native_attention.build())"],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[3])
    native_attention._library.cache_clear()
    try:
        assert use_native_decode("auto", torch.device("cpu"), torch.float32)
        built, _ = other.communicate(timeout=300)
        assert other.returncode == 0 and built.strip() == str(native_attention.library_path())
        assert calls.read_text().splitlines() == ["run"]
        assert [p.name for p in kernels.glob("*.so")] == [native_attention.library_path().name]
    finally:
        native_attention._library.cache_clear()


def test_a_copy_of_the_code_finds_the_build_the_original_made(tmp_path, monkeypatch):
    """A job's working directory under ``ray job submit`` is a copy of the code without the build
    (ignored by git): the build's place and name come from the source's content, not its path."""
    monkeypatch.delenv("RAYSAMPLE_KERNEL_DIR", raising=False)
    copy = tmp_path / "working_dir" / "native"
    shutil.copytree(native_attention.SOURCE.parent, copy, ignore=shutil.ignore_patterns("build"))
    assert native_build.library_path(copy / native_attention.SOURCE.name, native_attention.FLAGS) == \
        native_attention.library_path()
    (copy / "bfloat16.h").write_text((copy / "bfloat16.h").read_text() + "\n// changed\n")
    assert native_build.library_path(copy / native_attention.SOURCE.name, native_attention.FLAGS) != \
        native_attention.library_path()


def test_a_build_for_another_cpu_level_has_a_name_of_its_own(monkeypatch):
    """RAYSAMPLE_KERNEL_MARCH (docs/reliability.md) builds for that level instead of this CPU's own, and
    under another name, so the two builds never stand in for each other."""
    monkeypatch.delenv("RAYSAMPLE_KERNEL_MARCH", raising=False)  # set when the suite itself runs so
    own = native_attention.library_path()
    monkeypatch.setenv("RAYSAMPLE_KERNEL_MARCH", "x86-64-v3")
    assert native_build.target_flags(["-O3", "-march=native"]) == ["-O3", "-march=x86-64-v3"]
    assert native_attention.library_path() != own


def test_out_of_range_indices_are_refused_before_the_kernel_reads_memory():
    k_pool = v_pool = torch.zeros(4, 1, 2, 8)
    q_all, out = torch.zeros(3, 2, 8), torch.zeros(3, 2, 8)
    tables, token_index, query_pos = torch.tensor([[0, 3]]), torch.tensor([[2]]), torch.tensor([[3]])
    paged_decode(q_all, out, k_pool, v_pool, tables, token_index, query_pos, 1.0, None, None, None)
    for bad in ({"tables": torch.tensor([[0, 4]])}, {"token_index": torch.tensor([[3]])},
                {"query_pos": torch.tensor([[4]])}):
        args = {"tables": tables, "token_index": token_index, "query_pos": query_pos, **bad}
        with pytest.raises(ValueError, match="out of range"):
            paged_decode(q_all, out, k_pool, v_pool, args["tables"], args["token_index"], args["query_pos"],
                         1.0, None, None, None)
    with pytest.raises(ValueError, match="must come last"):  # the kernel would skip the real query silently
        paged_decode(q_all, out, k_pool, v_pool, tables, torch.tensor([[0, 2]]), torch.tensor([[-1, 3]]),
                     1.0, None, None, None)


def test_without_a_compiler_auto_falls_back_and_native_names_the_reason(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RAYSAMPLE_KERNEL_DIR", str(tmp_path))  # no build there
    monkeypatch.setenv("CXX", "no-such-compiler")
    native_attention._library.cache_clear()
    try:
        assert not use_native_decode("auto", torch.device("cpu"), torch.float32)
        assert "no-such-compiler" in caplog.text
        with pytest.raises(native_attention.NativeKernelUnavailable, match="no-such-compiler"):
            use_native_decode("native", torch.device("cpu"), torch.float32)
    finally:
        native_attention._library.cache_clear()  # the next caller loads the real build again


def test_segments_skip_wide_gaps_and_keep_narrow_ones():
    gap = MIN_GAP
    own = np.array([0, 1, 2, 2 + gap, 3 + gap, 100, 101])  # a narrow gap (gap - 1 blocks), then a wide one
    assert choose_segments(own) == [(0, 4 + gap), (100, 102)]
    assert choose_segments(np.array([7])) == [(7, 8)]
    assert choose_segments(np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kv_write_matches_index_copy(dtype):
    """Keys as rotated (contiguous per token) and values as projected (strided by the fused q/k/v width)."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, tokens, dim, blocks, block_size = 3, 7, 16, 5, 4
    key = torch.randn(1, tokens, kv_heads, dim, generator=generator).to(dtype).transpose(1, 2)[0]
    qkv = torch.randn(tokens, 9 * dim, generator=generator).to(dtype)
    value = qkv[:, 6 * dim:].view(tokens, kv_heads, dim).transpose(0, 1)
    slots = torch.randperm(blocks * kv_heads * block_size, generator=generator)[: tokens * kv_heads]
    pools = [torch.zeros(blocks, kv_heads, block_size, dim, dtype=dtype) for _ in range(4)]
    native_attention.write_kv(key, value, pools[0], pools[1], slots)
    for pool, new in ((pools[2], key), (pools[3], value)):
        pool.view(-1, dim).index_copy_(0, slots, new.transpose(0, 1).reshape(-1, dim))
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    with pytest.raises(ValueError, match="do not match"):
        native_attention.write_kv(key, value, pools[0], pools[1], slots[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_output_does_not_depend_on_threads_or_how_rows_split(dtype):
    """Threads take contiguous runs of (row, KV head) tasks of about equal work and prefetch the
    next ones: every task's output is the same bit for bit whatever the number of threads (more
    threads than tasks included), with rows of very different lengths and a row of padding only."""
    generator = torch.Generator().manual_seed(0)
    block_size, dim, kv_heads, groups = 4, 64, 3, 3
    lengths = [1, 97, 3, 40, 200, 2, 64, 9]
    tables, offset = [], 0
    for length in lengths:
        blocks = -(-length // block_size)
        tables.append(list(range(offset, offset + blocks)))
        offset += blocks
    order = torch.randperm(offset, generator=generator)  # blocks anywhere in the pool
    k_pool = torch.randn(offset, kv_heads, block_size, dim, generator=generator).to(dtype)
    v_pool = torch.randn(offset, kv_heads, block_size, dim, generator=generator).to(dtype)
    block_tables = torch.zeros(len(lengths), max(len(t) for t in tables), dtype=torch.long)
    for r, table in enumerate(tables):
        block_tables[r, : len(table)] = order[table]
    token_index = torch.arange(len(lengths)).view(-1, 1)
    query_pos = torch.tensor(lengths).view(-1, 1) - 1
    query_pos[5] = -1  # a row of padding: no real query, its output untouched
    q_all = torch.randn(len(lengths), kv_heads * groups, dim, generator=generator).to(dtype)
    outputs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 64):
            torch.set_num_threads(count)
            out = torch.full_like(q_all, 7.0)
            paged_decode(q_all, out, k_pool, v_pool, block_tables, token_index, query_pos, 0.125, None, None, None)
            outputs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
    assert (outputs[0][5] == 7.0).all() and not (outputs[0][:5] == 7.0).any()

"""The fixed-shape step (workers/model/static_decode.py): what CUDA graphs capture, checked on CPU.

Padding rows change nothing, the compiled proof traces one graph per shape with no break and
gives the eager path's tokens (on the goldens too), a prompt chunk as query rows equals the
variable-shape forward, and a capture that fails leaves the runner eager with one line.
"""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from golden_engine import GOLDEN, SETUPS, assert_same_record, run_setup

from workers.cpu import native_attention
from workers.model.model_runner import ModelRunner
from workers.model.static_decode import StaticDecoder, capture_sizes, table_widths
from workers.model.tiny import ensure_tiny_model
from workers.row_work import RowWork

pytestmark = pytest.mark.long  # over half a minute: scheduled early (tests/conftest.py)


def runner(dtype: str = "float32", **kwargs) -> ModelRunner:
    options = dict(max_model_len=256, max_rows=16, verify=False, decode_attention="torch", block_size=16,
                   prepack_cpu_weights=False)
    return ModelRunner(ensure_tiny_model("default"), "cpu", dtype, **{**options, **kwargs})


def prefilled(r: ModelRunner, count: int, seed: int = 0, shortest: int = 3) -> list[tuple[list[int], list[int]]]:
    """``count`` prompts of ``shortest``..40 tokens prefilled into their own blocks; (prompt, block table) each."""
    rng = random.Random(seed)
    rows = [([rng.randint(1, 400) for _ in range(rng.randint(shortest, 40))], list(range(i * 12, i * 12 + 12)))
            for i in range(count)]
    r.forward([RowWork(table, ids, 0, 1) for ids, table in rows])
    return rows


def decode_work(rows: list[tuple[list[int], list[int]]], token: int = 7) -> list[RowWork]:
    return [RowWork(table, [token + i], len(ids), 1, decode=True) for i, (ids, table) in enumerate(rows)]


def test_capture_sizes_and_widths():
    assert capture_sizes(64)[:12] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96]
    assert capture_sizes(64)[-1] == 256 and capture_sizes(12)[:6] == [1, 2, 4, 8, 12, 32]
    assert capture_sizes(64, [8, 4, 4]) == [4, 8]
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(8, [0])
    assert table_widths(40) == [1, 2, 4, 8, 16, 32, 40] and table_widths(1) == [1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padding_rows_change_nothing(dtype):
    """Three real rows padded to 4 and to 16 query rows: the same logits and the same real K/V, bit for bit;
    padding rows write only the padding block."""
    results = []
    for sizes in ([4], [16]):
        r = runner(dtype)
        rows = prefilled(r, 3)
        fixed = StaticDecoder(r, "eager", 16, sizes=sizes)
        work = decode_work(rows)
        shape = fixed.shape(work)
        assert shape[0] == sizes[0]
        logits = fixed.forward(work, shape)
        real = [torch.cat([pool[:36] for pool in r.cache.keys + r.cache.values])]
        untouched = [torch.cat([pool[36:-1] for pool in r.cache.keys + r.cache.values])]
        assert not untouched[0].any()  # no block between the rows' and the padding block was written
        results.append((logits, real[0]))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_fixed_shape_decode_equals_variable_shape():
    """A decode step through the fixed-shape forward gives the variable-shape forward's logits (float32)."""
    a, b = runner(), runner()
    rows = prefilled(a, 5)
    prefilled(b, 5)
    fixed = StaticDecoder(b, "eager", 16)
    for step in range(3):
        work = decode_work(rows, token=11 + step)
        want = a.forward(work)
        got = fixed.forward(work, fixed.shape(work))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        rows = [(ids + [11 + step + i], table) for i, (ids, table) in enumerate(rows)]


def test_prompt_chunks_as_query_rows_equal_variable_shape():
    """With graphs every step fits a capture size: a prompt chunk's tokens are query rows of their own.
    Checked in the eager mode of the same forward against the variable-shape forward (float32)."""
    a, b = runner(), runner()
    b.static = StaticDecoder(b, "eager", 16, every_step=True)
    rng = random.Random(3)
    prompts = [[rng.randint(1, 400) for _ in range(rng.randint(12, 30))] for _ in range(4)]
    tables = [list(range(i * 12, i * 12 + 12)) for i in range(4)]
    first = [RowWork(t, p[:10], 0, 1) for p, t in zip(prompts, tables)]
    rest = [RowWork(t, p[10:], 10, 2) for p, t in zip(prompts, tables)]  # two logits: a draft-like row
    for work in (first, rest):
        assert b.static.shape(work) is not None
        want, got = a.forward(work), b.forward(work)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_compiled_proof_one_graph_per_shape_and_eager_tokens():
    """enforce_eager=False on CPU: the fixed-shape forward under torch.compile(fullgraph=True); 50 decode
    steps whose row counts vary within one capture size trace one graph, and greedy tokens equal the
    default CPU path's (prepacked, native kernels)."""
    eager = ModelRunner(ensure_tiny_model("default"), "cpu", "float32", max_model_len=256, max_rows=16, verify=False)
    compiled = runner(enforce_eager=False, prepack_cpu_weights=True, decode_attention="auto")
    assert compiled.static is not None and compiled.static.mode == "compiled"
    rows = prefilled(eager, 8, shortest=33)  # positions 33..63: one table width (4 blocks of 16)
    prefilled(compiled, 8, shortest=33)
    tokens = [[7] for _ in rows]
    lengths = [len(ids) for ids, _ in rows]
    for step in range(50):
        live = 5 + step % 4  # 5..8 rows: capture size 8
        work = [RowWork(rows[i][1], [tokens[i][-1]], lengths[i], 1, decode=True) for i in range(live)]
        want, got = eager.forward(work), compiled.forward(work)
        assert torch.equal(want.argmax(-1), got.argmax(-1)), step
        for i in range(live):
            tokens[i].append(int(want[i].argmax()))
            lengths[i] += 1
        if max(lengths) >= 64:  # keep one table width (4 blocks of 16) for the whole run
            lengths = [len(ids) for ids, _ in rows]
    assert compiled.static.compiled_graphs == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_compiled_step_attends_with_the_native_kernel_and_equals_its_eager_run_bit_for_bit(dtype, monkeypatch):
    """On CPU the compiled fixed-shape step calls the C++ decode-attention kernel (one opaque operator),
    as the default path does, so a bfloat16 answer no longer meets another kernel's rounding; and it
    computes what the same forward run eagerly computes, bit for bit."""
    if not native_attention.available():
        pytest.skip("the native CPU decode attention could not be built here (no C++ compiler)")
    calls = []
    kernel = native_attention.paged_decode
    monkeypatch.setattr(native_attention, "paged_decode", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    compiled = runner(dtype, enforce_eager=False, decode_attention="auto")
    plain = runner(dtype, decode_attention="auto")
    fixed = StaticDecoder(plain, "eager", 16)
    rows = prefilled(compiled, 6, shortest=20)
    prefilled(plain, 6, shortest=20)
    for step in range(3):
        work = decode_work(rows, token=7 + step)
        calls.clear()
        got = compiled.forward(work)
        assert len(calls) == compiled.num_layers  # one kernel call a layer, from inside the compiled graph
        assert torch.equal(got, fixed.forward(work, fixed.shape(work))), step
    assert compiled.static.compiled_graphs == 1


def test_failed_capture_falls_back_with_one_line(monkeypatch, caplog):
    r = runner()
    rows = prefilled(r, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", broken)
    r.static = StaticDecoder(r, "graphs", 16)
    with caplog.at_level(logging.WARNING, logger="workers.model.static_decode"):
        assert r.static.capture() is False
    lines = [rec.getMessage() for rec in caplog.records if "CUDA graph capture failed" in rec.getMessage()]
    assert len(lines) == 1 and "operation not permitted" in lines[0] and "enforce_eager" in lines[0]
    work = decode_work(rows)
    assert r.static.shape(work) is None  # no graphs: the variable-shape forward runs
    assert r.forward(work).shape == (2, r.vocab_size)


def test_layers_dispatch_few_operators():
    """The top-level operators one decoder layer dispatches in the fixed-shape forward (what the GPU's
    graphs capture; bench/decode_ops.py counts them on the real model): merged projections and fused
    norms keep a layer far under transformers' ~80 in that forward."""
    from torch.profiler import ProfilerActivity, profile, record_function

    r = runner(merge_projections=True, batch_invariant=False)  # no CPU row windows: the linears as on a GPU
    rows = prefilled(r, 4)
    fixed = StaticDecoder(r, "eager", 16)
    work = decode_work(rows)
    layers = r.model.model.layers
    for layer in layers:
        inner = layer.forward

        def traced(*args, _inner=inner, **kwargs):
            with record_function("decoder_layer"):
                return _inner(*args, **kwargs)

        layer.forward = traced
    fixed.forward(work, fixed.shape(work))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fixed.forward(work, fixed.shape(work))
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, in_layer = event.cpu_parent, False
        while parent is not None and not parent.name.startswith("aten::"):
            in_layer |= parent.name == "decoder_layer"
            parent = parent.cpu_parent
        count += parent is None and in_layer
    assert 0 < count / len(layers) <= 50, count / len(layers)


EXPECTED = json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name,workers,extra", [s for s in SETUPS if s[0] in ("w1", "w2-tight")],
                         ids=["w1", "w2-tight"])
def test_goldens_through_the_compiled_fixed_shape_step(name, workers, extra):
    """enforce_eager=False: every golden token, finish reason and text as recorded; logprobs within tolerance."""
    got = run_setup(workers, {**extra, "model": {"tiny": "loopy", "max_model_len": 160, "enforce_eager": False}})
    want = EXPECTED[name]
    assert got["outputs"].keys() == want["outputs"].keys()
    for rid, expected in want["outputs"].items():
        assert_same_record(got["outputs"][rid], expected, rid)


def test_rows_the_variable_forward_refuses_are_refused_alike():
    """A row the fixed-shape step cannot run as given (too few blocks, too many logits, past max_model_len)
    goes to the variable-shape forward, which names what is wrong; a block id outside the cache is refused."""
    r = runner()
    rows = prefilled(r, 2)
    r.static = StaticDecoder(r, "eager", 16, every_step=True)
    (ids, table), _ = rows
    for bad, match in ((RowWork(table[:1], [5], 40, 1, decode=True), "blocks hold"),
                       (RowWork(table, [5, 6], len(ids), 3), "cannot give"),
                       (RowWork(table, [5], 256, 1, decode=True), "max_model_len")):
        assert r.static.shape([bad]) is None
        with pytest.raises(ValueError, match=match):
            r.forward([bad])
    outside = RowWork([r.cache.num_blocks + 5] * 12, [5], 3, 1, decode=True)
    with pytest.raises(ValueError, match="out of the cache's range"):
        r.forward([outside])


def test_graphs_run_the_synchronous_step_by_default():
    """Where steps replay CUDA graphs the step waits for its plan unless async_scheduling says otherwise
    (measured faster on an H100); eager GPU workers keep the pipelined step, CPU workers the synchronous one."""
    from cluster.engine.setup import worker_setup
    from cluster.preflight import prepare_run
    from workers.step.worker import pipelined

    def config(scheduler=None, **model):
        return worker_setup(prepare_run({"model": {"tiny": "default", **model}, "cluster": {"gpus_per_worker": 0},
                                         "scheduler": scheduler or {}}, local=True))

    assert not pipelined(config(), "cuda")
    assert pipelined(config(enforce_eager=True), "cuda")
    assert not pipelined(config(), "cpu") and not pipelined(config(enforce_eager=False), "cpu")
    forced = config({"async_scheduling": True})
    assert pipelined(forced, "cuda")


@pytest.mark.parametrize("attention", ["torch", "flex"])
def test_the_fixed_shape_forward_checks_itself_against_the_variable_shape_one(attention):
    """What a GPU runs after capturing its graphs: a probe's decode step both ways, on blocks no request holds;
    the same logits (FlexAttention's graph path too), and a decoder that computed wrongly is caught."""
    r = runner(decode_attention=attention)
    fixed = StaticDecoder(r, "eager", 16)
    assert fixed.disagreement() is None
    fixed._forward_shape = lambda size, width, real=fixed._forward_shape: real(size, width) * 1.01
    assert "differ from the variable-shape forward" in fixed.disagreement()


def test_a_llama3_2_1b_shaped_model_gives_transformers_eager_greedy_tokens_through_the_static_path():
    """A 1B-class shape (Llama-3.2-1B's layers of 2048, 32 heads over 8 KV heads, a 128k vocabulary, tied
    embeddings), random weights built from the preset's seed: the compiled fixed-shape decode
    (``enforce_eager: false``, the CPU proof of a GPU's graphs, on merged layers) gives transformers' eager
    float32 greedy tokens, token for token. 4 of its 16 layers: every matrix has the preset's shape, and the
    other 12 would only repeat them (they took 60% of this test's minute, building and running the model twice)."""
    import dataclasses

    from transformers import AutoConfig

    from workers.model.tiny import PRESETS, random_model, random_weights_seed

    path = ensure_tiny_model(dataclasses.replace(PRESETS["llama3.2-1b-shape"], num_hidden_layers=4))
    prompts = [[101, 2000, 3000, 400, 55, 66, 77, 88, 99, 1234, 4321], [5, 6, 7, 8, 9, 10, 11]]
    reference = random_model(AutoConfig.from_pretrained(path), random_weights_seed(path), torch.float32, "cpu")
    reference.set_attn_implementation("eager")
    with torch.inference_mode():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    del reference
    r = ModelRunner(path, "cpu", "float32", max_model_len=64, max_rows=2, enforce_eager=False, batch_invariant=False,
                    verify=False, kv_cache_memory=64 << 20)
    assert r.static.mode == "compiled" and all(hasattr(layer.self_attn, "qkv_proj") for layer in r.model.model.layers)
    tables = [list(range(0, 4)), list(range(4, 8))]
    got = [[int(x)] for x in r.forward([RowWork(t, p, 0, 1) for t, p in zip(tables, prompts)]).argmax(-1)]
    for _ in range(5):
        work = [RowWork(t, [g[-1]], len(p) + len(g) - 1, 1, decode=True) for t, p, g in zip(tables, prompts, got)]
        assert r.static.shape(work) is not None  # the fixed-shape forward takes the step
        for tokens, token in zip(got, r.forward(work).argmax(-1).tolist()):
            tokens.append(token)
    assert got == want and r.static.compiled_graphs >= 1

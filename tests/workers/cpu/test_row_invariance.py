"""A row's output of a CPU linear does not depend on how many rows share the matmul (issue 57).

No machine here has the Intel AMX CPU where oneDNN's bfloat16 kernel changes at 33 rows, so fake
kernels that change their bits by the row count stand in for it; MKL's float32 GEMM, which on the
AMD EPYC here gives a row other bits at nearly every count, is a real one. The real model's every
linear shape is swept over every row count the runner can give it (1 to 128; the LM head, which
sees only sampled rows, 1 to 64), as the runner builds it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cluster.config import resolve
from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams
from workers.cpu import row_invariance
from workers.cpu.cpu_linear import PrepackedLinear, prepack_available
from workers.cpu.row_invariance import RowWindow, find_window, make_rows_independent, probe_counts, run_in_window
from workers.model.model_runner import ModelRunner

CPU = torch.device("cpu")


def small_integers(*shape: int) -> torch.Tensor:
    """Values whose products and sums are exact in float32: any kernel, any order, the same bits."""
    return torch.randint(-3, 4, shape).float()


def one_row_at_a_time(weight: torch.Tensor):
    """A kernel whose row cannot depend on the others (the fakes start from it; the probe's inputs are not integers)."""
    return lambda x: torch.stack([weight @ row for row in x]) if len(x) else x.new_zeros(0, weight.shape[0])


def fake_amx(weight: torch.Tensor, threshold: int = 32):
    """A kernel that, like oneDNN's bfloat16 one on an AMX Xeon, gives other bits past ``threshold`` rows."""

    exact = one_row_at_a_time(weight)

    def compute(x: torch.Tensor) -> torch.Tensor:
        out = exact(x)
        return out if x.shape[0] <= threshold else out * (1 + 2**-20) + 0.5**20

    return compute


def sweep(compute, x: torch.Tensor, counts) -> list[int]:
    """Row counts at which some row's bits differ from that row's in a call of all of ``x`` (1 is a count: alone)."""
    full = compute(x)
    return [m for m in counts if not torch.equal(compute(x[:m]), full[:m])]


def windowed(compute, window: RowWindow | None):
    return compute if window is None else (lambda x: run_in_window(compute, x, window))


def test_probe_counts_cover_every_small_count_and_each_kernel_boundary():
    assert probe_counts(20) == [*range(1, 18), 20]
    assert probe_counts(300, every_to=100)[:100] == list(range(1, 101))  # every count a decode step can have
    counts = probe_counts(2048)
    assert {31, 32, 33, 48, 63, 64, 65, 1023, 1024, 1025, 2047, 2048} <= set(counts) and max(counts) == 2048


def test_a_kernel_that_changes_past_32_rows_runs_in_windows_of_32_and_is_invariant_at_every_count():
    torch.manual_seed(0)
    weight, x = small_integers(300, 512), small_integers(128, 512)
    compute = fake_amx(weight)
    assert sweep(compute, x, range(1, 129)) == list(range(1, 33))  # the fake bites, as AMX did: M <= 32 differ from 128
    window = find_window(compute, 512, torch.float32, CPU, 128)
    assert window == RowWindow(1, 32)
    assert sweep(windowed(compute, window), x, range(1, 129)) == []


def test_a_kernel_that_differs_at_every_count_runs_in_a_fixed_count():
    """Each count its own bits (MKL's float32 GEMM here): only padding to one count pins a row's bits."""
    torch.manual_seed(1)
    weight, x = small_integers(64, 96), small_integers(100, 96)

    exact = one_row_at_a_time(weight)

    def compute(rows: torch.Tensor) -> torch.Tensor:
        return exact(rows) * (1 + rows.shape[0] * 2**-20) + 0.5**20

    window = find_window(compute, 96, torch.float32, CPU, 100)
    assert window == RowWindow(16, 16)  # near a decode step's rows (16 unless told): little padding, few splits
    assert sweep(windowed(compute, window), x, range(1, 101)) == []
    assert find_window(compute, 96, torch.float32, CPU, 100, decode_rows=64) == RowWindow(64, 64)
    assert find_window(compute, 96, torch.float32, CPU, 100, decode_rows=3) == RowWindow(4, 4)


def test_a_kernel_whose_bits_depend_on_a_rows_position_is_run_one_row_at_a_time():
    torch.manual_seed(2)
    weight, x = small_integers(32, 48), small_integers(40, 48)

    exact = one_row_at_a_time(weight)

    def compute(rows: torch.Tensor) -> torch.Tensor:
        out = exact(rows)
        return out + (torch.arange(rows.shape[0])[:, None] % 2) * (out * 2**-18 + 0.5**20)  # odd positions: other bits

    assert find_window(compute, 48, torch.float32, CPU, 40) == RowWindow(1, 1)
    assert sweep(windowed(compute, RowWindow(1, 1)), x, range(1, 41)) == []


def test_an_invariant_kernel_is_left_as_it_is():
    assert find_window(one_row_at_a_time(torch.randn(64, 96)), 96, torch.float32, CPU, 300) is None


def test_padding_and_splitting_give_the_rows_in_order():
    x = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    calls = []

    def compute(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows * 2

    assert torch.equal(run_in_window(compute, x, RowWindow(16, 16)), x * 2)
    assert calls == [16] * 5
    calls.clear()
    assert torch.equal(run_in_window(compute, x[:5], RowWindow(8, 32)), x[:5] * 2) and calls == [8]


SEQUENCES, STEP_ROWS = 64, 128  # the runner's rows a step: sampled ones (the LM head's), and all (the other linears')


def real_model_runner(prepack: bool, dtype: str = "float32") -> ModelRunner:
    facts = resolve({"model": {"preset": "smollm2-135m-instruct"}}).facts
    return ModelRunner(facts.path, "cpu", dtype, max_model_len=256, prepack_cpu_weights=prepack, max_rows=SEQUENCES,
                       max_step_tokens=2 * STEP_ROWS, verify=False, model_config=facts.hf_config)


@pytest.mark.parametrize(("prepack", "dtype"), [(True, "float32"), (False, "float32"), (True, "bfloat16")],
                         ids=["prepacked", "torch-matmul", "prepacked-bfloat16"])
def test_every_linear_shape_of_the_real_model_gives_a_row_the_same_bits_at_every_row_count_it_can_get(prepack, dtype):
    """As the runner builds them: oneDNN's prepacked linears (the default) and torch's own matmul
    (``model.cpu_weight_prepack: false``: MKL here, not invariant by itself, so it gets windows); and
    in bfloat16 where oneDNN has native bfloat16 kernels (the issue's Intel AMX Xeon changed kernels
    at 33 rows there), a CPU without them runs the float32 cases only. Every count from 1: to 128
    for the linears of a step's tokens, to the 64 sequences a step samples for the LM head, which
    only sampled rows reach (the head is nine tenths of the cost: 49,152 outputs a row)."""
    if prepack and not prepack_available(CPU, getattr(torch, dtype)):
        pytest.skip(f"no native oneDNN {dtype} linear kernels on this CPU and torch build")
    runner = real_model_runner(prepack, dtype)
    head = runner.model.get_output_embeddings()
    shapes: dict[tuple, nn.Module] = {}
    for module in runner.model.modules():
        if isinstance(module, PrepackedLinear) or type(module) is nn.Linear:
            shapes.setdefault((module.in_features, module.out_features, module is head), module)
    assert len(shapes) >= 4 and any(is_head for *_, is_head in shapes)
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for (width, out, is_head), module in shapes.items():
            rows = SEQUENCES if is_head else STEP_ROWS
            x = (torch.randn(rows, width, generator=generator) * 3).to(runner.dtype)
            assert sweep(module, x, range(1, rows + 1)) == [], (width, out)


def test_seeded_requests_alone_equal_batched_where_a_kernel_changes_with_the_row_count(monkeypatch):
    """The engine on a CPU whose prepacked linears add in another order past 32 rows (the fake):
    with the probe each request alone gives its tokens in the batch; without it they differ."""
    if not prepack_available(CPU, torch.float32):
        pytest.skip("this torch build has no oneDNN linear ops")
    exact = PrepackedLinear.compute

    def rounds_by_rows(self, flat: torch.Tensor) -> torch.Tensor:
        out = exact(self, flat)
        return out if flat.shape[0] <= 4 else out * (1 + 2**-6)  # the fake: past 4 rows, other bits

    monkeypatch.setattr(PrepackedLinear, "compute", rounds_by_rows)
    monkeypatch.setattr(row_invariance, "_stored", lambda store, key, find, limit: find())  # no verdict of the fake kept
    config = {"model": {"tiny": "default", "max_model_len": 128}, "scheduler": {"max_num_seqs": 8}}
    prompts = [f"request {i} " + "word " * (3 + 2 * i) for i in range(8)]
    params = [SamplingParams(seed=i, temperature=1.0, max_tokens=12, ignore_eos=True) for i in range(8)]

    def alone_and_batched() -> tuple[list, list]:
        engine = LocalEngine(config)
        try:
            batched = [o.token_ids for o in engine.generate(prompts, params)]
            alone = [engine.generate(p, s)[0].token_ids for p, s in zip(prompts, params)]
        finally:
            engine.shutdown()
        return alone, batched

    alone, batched = alone_and_batched()
    assert alone == batched
    monkeypatch.setattr("workers.model.model_runner.make_rows_independent", lambda *args, **kwargs: {})
    alone, batched = alone_and_batched()
    assert alone != batched  # the fake does change tokens: the probe above is what kept them equal


def test_a_kept_verdict_is_read_only_where_the_same_kernels_run(monkeypatch, tmp_path):
    """A verdict found under other kernel settings or another thread count is not reused."""
    shape = ("PrepackedLinear", 576, 1536, True, "torch.bfloat16", 2048, 64)
    key = row_invariance._host_key(shape)
    assert row_invariance._host_key(shape[:-1] + (16,)) != key
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert row_invariance._host_key(shape) != key
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert row_invariance._host_key(shape) != key
    finally:
        torch.set_num_threads(threads)
    assert row_invariance._host_key(shape) == key
    found = []
    window = row_invariance._stored(tmp_path, key, lambda: found.append(1) or RowWindow(8, 32), 64)
    assert window == row_invariance._stored(tmp_path, key, lambda: found.append(1) or None, 64) == RowWindow(8, 32)
    assert found == [1]  # probed once, read back the second time


@pytest.mark.parametrize("enforce_eager", [None, False], ids=["default", "compiled-decode"])
def test_a_seeded_requests_tokens_and_logprobs_alone_are_its_batched_ones_bit_for_bit(enforce_eager):
    """Prompts of different lengths prefilled in one step, then decoded together, against each alone:
    the same tokens and the same logprob bits. On CPU each prompt's prefill attention runs on its own
    (padded beside a longer prompt, torch's attention gave one of these six other bits: 4.8e-6), and
    with ``enforce_eager: false`` torch's own linears (MKL here, whose rows vary with the count) are
    windowed in the compiled decode and the prefill alike (without: 5.7e-6 apart)."""
    config = {"model": {"tiny": "default", "max_model_len": 128, "enforce_eager": enforce_eager},
              "scheduler": {"max_num_seqs": 8}}
    prompts = [f"request {i} " + "word " * (3 + 2 * i) for i in range(6)]
    params = [SamplingParams(seed=i, temperature=1.0, max_tokens=10, ignore_eos=True, logprobs=0) for i in range(6)]

    def record(out) -> tuple:
        return tuple(out.token_ids), tuple(tuple(d.items()) for d in out.outputs[0].logprobs)

    engine = LocalEngine(config)
    try:
        batched = [record(o) for o in engine.generate(prompts, params)]
        assert [record(engine.generate(p, s)[0]) for p, s in zip(prompts, params)] == batched
    finally:
        engine.shutdown()


def test_workers_that_start_together_probe_a_layer_once(tmp_path):
    """A cold host: the first worker probes while the others wait, then they read its verdict (a window,
    or none needed, which is saved too); an unreadable verdict is probed again."""
    import threading
    import time

    calls: list[str] = []

    def probe(window):
        def find():
            calls.append("probe")
            time.sleep(0.3)  # the others arrive while it probes
            return window
        return find

    store = tmp_path / "row-probes"
    for key, window in (("windowed", row_invariance.RowWindow(4, 64)), ("plain", None)):
        calls.clear()
        results = []
        threads = [threading.Thread(target=lambda: results.append(row_invariance._stored(store, key, probe(window), 64)))
                   for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert calls == ["probe"] and results == [window] * 3, (key, calls, results)
    (store / "plain.json").write_text("{not json")
    calls.clear()
    assert row_invariance._stored(store, "plain", probe(None), 64) is None and calls == ["probe"]
    assert row_invariance._stored(None, "any", probe(None), 64) is None and calls == ["probe", "probe"]  # no store: no cache


def test_an_unwritable_store_only_means_probing_every_time(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    found = row_invariance.RowWindow(2, 32)
    assert row_invariance._stored(blocker / "row-probes", "key", lambda: found, 64) == found
    assert row_invariance._stored(blocker / "row-probes", "key", lambda: None, 64) is None  # probed again

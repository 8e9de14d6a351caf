"""A row's output of a CPU linear does not depend on how many rows share the matmul: every call has one
fixed row count (``workers/cpu/row_tiles.py``, issue 80; tests/workers/cpu/test_batch_invariance.py proves
the engine with fake kernels). Here: the tiles themselves, the per-host check that a kernel's rows are
independent at the tile's count, the real model's every linear shape swept over every row count the runner
can give it (1 to 128; the LM head, which sees only sampled rows, 1 to 64), as the runner builds it, and the
probe that finds where a kernel as it is varies (``workers/cpu/row_invariance.py``: a diagnostic now,
``bench/amx_check.py``'s, no longer the engine's mechanism).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cluster.config import resolve
from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams
from workers.cpu import row_tiles
from workers.cpu.cpu_linear import PrepackedLinear, prepack_available
from workers.cpu.row_invariance import RowWindow, find_window, probe_counts, run_in_window
from workers.cpu.row_tiles import fix_row_counts, in_tiles, rows_independent
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


def recording_doubler():
    """A kernel that doubles its rows (any order gives the same bits) and the row count of each call."""
    calls: list[int] = []

    def compute(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows * 2

    return compute, calls


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


def test_padding_and_splitting_give_the_rows_in_order():
    x = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    compute, calls = recording_doubler()

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
    (``model.cpu_weight_prepack: false``: MKL here, not invariant by itself); and
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


def test_tiles_pad_and_split_every_call_to_the_fixed_count_and_keep_the_rows_in_order():
    x = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    compute, calls = recording_doubler()

    for count in (1, 16, 17, 70):
        calls.clear()
        assert torch.equal(in_tiles(compute, x[:count], 16), x[:count] * 2)
        assert set(calls) == {16} and len(calls) == -(-count // 16)
    calls.clear()
    assert torch.equal(in_tiles(compute, x[:5], 16, one_per_call=True), x[:5] * 2) and calls == [16] * 5


def test_a_short_call_takes_the_smallest_ladder_size_that_holds_it():
    x = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    compute, calls = recording_doubler()

    for count, expected in ((1, [4]), (4, [4]), (5, [8]), (9, [16]), (16, [16]), (17, [16, 4]), (30, [16, 16]),
                            (0, [4])):
        calls.clear()
        assert torch.equal(in_tiles(compute, x[:count], 16, smaller=(4, 8)), x[:count] * 2)
        assert calls == expected, (count, calls)
    assert row_tiles.ladder(64, 8) == (8, 16, 24, 32, 40, 48, 56) and row_tiles.ladder(48, 20) == (20, 40)
    assert row_tiles.ladder(64, 64) == () and row_tiles.ladder(64, 100) == () and row_tiles.ladder(4, 1) == (1, 2, 3)


def test_only_the_ladder_sizes_whose_kernel_gives_the_tiles_bits_are_used(tmp_path, monkeypatch):
    """A kernel like AMX's bfloat16 one (other bits at 32 rows or fewer) agrees with the 64-row tile only at the
    ladder's sizes above 32: short calls take 40, 48, 56 or 64 rows. One with other bits at 16 rows or fewer
    keeps 24 to 56; an exact one keeps the whole ladder."""
    weight = small_integers(32, 48) + torch.rand(32, 48)  # not exact: a kernel's order shows in the bits
    exact = one_row_at_a_time(weight)

    def other_bits_at_or_below(threshold: int):
        def compute(x: torch.Tensor) -> torch.Tensor:
            out = exact(x)
            return out * (1 + 2**-20) + 0.5**20 if x.shape[0] <= threshold else out
        return compute

    for kernel, sizes in ((fake_amx(weight, 32), (40, 48, 56, 64)), (other_bits_at_or_below(16), (24, 32, 40, 48, 56, 64)),
                           (exact, (8, 16, 24, 32, 40, 48, 56, 64))):
        model = nn.Sequential(nn.Linear(48, 32, bias=False))
        monkeypatch.setattr(row_tiles, "kernel_of", lambda module, k=kernel: k if type(module) is nn.Linear else None)
        fix_row_counts(model, 64, None, smallest=8)
        assert model[0].row_sizes == sizes
        x = torch.randn(70, 48)
        in_a_tile = torch.cat([kernel(x[:64]), kernel(torch.cat([x[64:], x.new_zeros(58, 48)]))[:6]])
        for count in (1, 9, 33, 70):  # whatever the count, a row's bits are the ones it has in a tile
            assert torch.equal(model(x[:count]), in_a_tile[:count]), (sizes, count)


def test_a_kernel_whose_rows_depend_on_their_place_in_the_call_runs_one_real_row_a_call(tmp_path, caplog):
    """The construction needs one thing of a kernel at the tile's count: that a row's bits do not depend on
    its place or its neighbours. Checked once per host; a kernel that fails it computes one real row a call."""
    weight = small_integers(32, 48)
    exact = one_row_at_a_time(weight)

    def by_position(rows: torch.Tensor) -> torch.Tensor:
        out = exact(rows)
        return out + (torch.arange(rows.shape[0])[:, None] % 2) * (out * 2**-18 + 0.5**20)  # odd positions differ

    assert rows_independent(exact, 48, torch.float32, 16)
    assert not rows_independent(by_position, 48, torch.float32, 16)

    model = nn.Sequential(nn.Linear(48, 32, bias=False))
    model[0].weight.data = weight
    installed = fix_row_counts(model, 16, tmp_path)
    assert installed == {"0": 16}
    verdicts = list(tmp_path.glob("*.json"))
    assert [v.read_text() for v in verdicts] == ["true"]
    verdicts[0].write_text('{"low": 0}')  # damaged: checked again, and kept as it is
    assert fix_row_counts(nn.Sequential(nn.Linear(48, 32, bias=False)), 16, tmp_path) == {"0": 16}
    assert verdicts[0].read_text() == "true"


def test_workers_that_start_together_check_a_shape_once(tmp_path):
    import threading
    import time

    calls: list[str] = []

    def check() -> bool:
        calls.append("check")
        time.sleep(0.3)  # the others arrive while it checks
        return True

    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(row_tiles._checked(tmp_path, "key", check)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert calls == ["check"] and results == [True] * 3
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert row_tiles._checked(blocker / "row-tiles", "key", lambda: True)  # an unwritable store: checked each time

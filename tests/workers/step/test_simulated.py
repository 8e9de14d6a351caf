"""Simulated GPU workers (``model.simulate``): modelled step time, placement-independent tokens."""

from __future__ import annotations

import time

import pytest

from cluster.config import ConfigError, load_config
from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams
from workers.doubles.simulated_runner import PRESETS, ComputeModel, SimulatedRunner
from workers.row_work import RowWork
from workers.sample.sampler import Sampler

PROMPTS = ["Hello there", "The quick brown fox", "a b c d e f", "Numbers: 1 2 3"]


def simulated(workers: int, **simulate) -> dict:
    return {"model": {"tiny": "default", "max_model_len": 128,
                      "simulate": simulate or {"fixed_ms": 0.2, "per_token_ms": 0.01}},
            "cluster": {"num_workers": workers}, "scheduler": {"max_num_seqs": 8}}


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=2),  # unseeded: keyed by id
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)]


def test_the_roofline_preset_models_an_8b_model_on_an_h100():
    h100 = PRESETS["llama-8b-h100"]
    assert 4.5e-3 < h100.fixed_s < 5.0e-3  # 16 GB of weights at 3.35 TB/s
    assert 3.0e-5 < h100.per_token_s < 3.5e-5  # 16 GFLOP a token at half of 989 TFLOP/s
    assert h100.step_seconds(256) == pytest.approx(h100.fixed_s + 256 * h100.per_token_s)


def test_the_runner_takes_the_modelled_time_and_its_logits_depend_only_on_the_row():
    slept = []
    runner = SimulatedRunner(ComputeModel(0.004, 0.001), vocab_size=64, max_model_len=32, num_blocks=8,
                             sleep=slept.append)
    before = time.perf_counter()
    a = runner.forward([RowWork([0], [5, 6, 7], 0, 2), RowWork([1], [9], 4, 1)])
    # A launch returns at once with the logits (making them is the device's work, within the
    # modelled time); reading the step's results waits for what is left of it.
    assert slept == [] and a.shape == (3, 64)
    assert before + 0.008 <= runner.ready_at <= time.perf_counter() + 0.008
    runner.wait_ready()
    assert len(slept) == 1 and 0 < slept[0] <= 0.008
    assert runner.simulated_s == pytest.approx(0.008) and 0 < runner.device_cpu_s < 0.008
    first_end = runner.ready_at
    b = runner.forward([RowWork([3], [9], 4, 1)])  # the same last token at the same position, alone
    assert (a[2] == b[0]).all() and not (a[0] == a[1]).all()
    assert runner.ready_at >= first_end + 0.005  # the device runs one step after the other (none was slept)


def test_a_simulated_worker_samples_within_the_modelled_step_then_waits_for_its_end(monkeypatch):
    """The sampler's work on simulated logits is the device's (a GPU samples on the device): each
    step samples before the worker waits for the modelled step to end, and only then are its
    tokens read (returned, or fed to the forward launched ahead)."""
    events = []
    sample = Sampler.__call__
    monkeypatch.setattr(Sampler, "__call__", lambda *a, **k: events.append("sample") or sample(*a, **k))
    for pipelined in (False, True):
        config = simulated(1)
        config["scheduler"]["async_scheduling"] = pipelined
        engine = LocalEngine(config)
        runner = engine.workers[0].runner
        assert isinstance(engine.workers[0].sampler, Sampler)
        events.clear()
        wait_ready, forward = runner.wait_ready, runner.forward
        runner.wait_ready = lambda wait_ready=wait_ready: events.append("wait") or wait_ready()
        runner.forward = lambda rows, forward=forward: events.append("forward") or forward(rows)
        outs = engine.generate(PROMPTS, params())
        assert all(len(c.token_ids) == 12 for o in outs for c in o.outputs)
        steps = "".join(e[0] for e in events)  # f(orward), s(ample), w(ait)
        assert steps.count("s") == steps.count("w") > 10 and "ss" not in steps and "ww" not in steps
        assert all(steps[i + 1] == "w" for i, e in enumerate(steps) if e == "s")


def test_tokens_do_not_depend_on_the_number_of_workers():
    outs = {w: LocalEngine(simulated(w)).generate(PROMPTS, params()) for w in (1, 2)}
    for one, two in zip(outs[1], outs[2]):
        assert [c.token_ids for c in one.outputs] == [c.token_ids for c in two.outputs]
        assert all(len(c.token_ids) == 12 for c in one.outputs)
    assert len({tuple(o.token_ids) for o in outs[1]}) == len(PROMPTS)


def test_simulate_settings_are_checked():
    with pytest.raises(ConfigError, match="needs preset, or fixed_ms and per_token_ms"):
        load_config(simulated(1, preset="llama-8b-h100", fixed_ms=1.0))
    with pytest.raises(ConfigError, match="unknown simulate preset 'a100'; presets: llama-8b-h100"):
        load_config(simulated(1, preset="a100"))
    assert load_config(simulated(1, preset="llama-8b-h100")).model.simulate.compute_model() == PRESETS["llama-8b-h100"]

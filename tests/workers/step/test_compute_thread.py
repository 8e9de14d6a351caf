"""One thread runs a process's model work (``workers.step.compute_thread``): on CPU a second thread
running torch ops would slow every op of the engine (libgomp's throttled waits once a process has
more OpenMP threads than cores; not a timing asserted here, the structure that avoids it is)."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest
import torch

import workers.step.worker as worker_module
from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams
from workers.step import compute_thread as ct
from workers.step.threads import set_cpu_threads


def test_run_returns_raises_and_runs_inline_on_the_thread():
    thread = ct.compute_thread()
    assert thread.run(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        thread.run(lambda: (_ for _ in ()).throw(ValueError("bad")))
    # A job that asks the thread for more work gets it at once, not behind itself (no deadlock).
    names = thread.run(lambda: (threading.current_thread().name, thread.run(lambda: threading.current_thread().name)))
    assert names == ("raysample-compute", "raysample-compute")


def test_an_abandoned_thread_cancels_what_it_has_not_started_and_the_next_call_gets_a_new_thread():
    old = ct.compute_thread()
    started, gate = threading.Event(), threading.Event()
    stuck = old.submit(lambda: started.set() or gate.wait())
    queued = old.submit(lambda: "never")
    assert started.wait(10)
    ct.abandon_compute_thread()
    new = ct.compute_thread()
    assert new is not old and new.run(lambda: 7) == 7  # the stuck thread holds nothing up
    gate.set()  # the stuck job ends; the one behind it never runs
    assert stuck.result(timeout=10) is True
    with pytest.raises(CancelledError):
        queued.result(timeout=10)


def test_the_thread_count_set_for_a_worker_reaches_the_compute_thread():
    before = torch.get_num_threads()
    ct.compute_thread().run(torch.get_num_threads)  # started before the count changes
    try:
        set_cpu_threads(1.0)
        assert ct.compute_thread().run(torch.get_num_threads) == 1
    finally:
        set_cpu_threads(float(before))
    assert ct.compute_thread().run(torch.get_num_threads) == before


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_engine_loads_runs_and_samples_its_model_on_the_compute_thread(monkeypatch, pipelined):
    """Loading (weights, the attention probe, layer fusion), every forward (the one launched ahead
    too) and every sampling pass: the same thread, never the caller's or the executor's."""
    seen: dict[str, set[str]] = {"load": set(), "forward": set(), "sample": set()}
    build = worker_module.build_runner

    def recorded_build(*args, **kwargs):
        seen["load"].add(threading.current_thread().name)
        runner = build(*args, **kwargs)
        forward = runner.forward

        def recorded_forward(rows):
            seen["forward"].add(threading.current_thread().name)
            return forward(rows)

        runner.forward = recorded_forward
        return runner

    monkeypatch.setattr(worker_module, "build_runner", recorded_build)
    engine = LocalEngine({"model": {"tiny": "default", "max_model_len": 64}, "cluster": {"num_workers": 2},
                          "scheduler": {"max_num_seqs": 4, "async_scheduling": pipelined}})
    for worker in engine.workers:
        sample = worker.sampler.__call__

        def recorded_sample(*args, sample=sample, **kwargs):
            seen["sample"].add(threading.current_thread().name)
            return sample(*args, **kwargs)

        worker.sampler = type("Recorded", (), {"__call__": staticmethod(recorded_sample),
                                               "__getattr__": lambda self, name, s=worker.sampler: getattr(s, name)})()
    outs = engine.generate(["a b", "c d e", "f"], SamplingParams(max_tokens=6, temperature=0.8, seed=1))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    if pipelined:
        assert engine.stats()["ahead_rows"] > 0
    engine.shutdown()
    assert seen == {"load": {"raysample-compute"}, "forward": {"raysample-compute"}, "sample": {"raysample-compute"}}


def test_at_exit_queued_work_ends_first_the_thread_stays_idle_and_no_new_thread_starts(monkeypatch):
    """Exit drains the thread rather than ending it (a thread ending frees its OpenMP team in a
    destructor that would race the process's own), and model work asked for after that is refused."""
    thread = ct.compute_thread()
    gate = threading.Event()
    slow = thread.submit(lambda: gate.wait(10) and "done")
    threading.Timer(0.2, gate.set).start()
    thread.drain(timeout_s=10)
    assert slow.done() and slow.result() == "done"
    assert thread._thread.is_alive() and thread.run(lambda: 1) == 1
    monkeypatch.setattr(ct, "_current", None)
    monkeypatch.setattr(ct, "_exiting", True)
    with pytest.raises(RuntimeError, match="exiting"):
        ct.compute_thread()

"""Throughput as simulated GPU workers and engines grow: tokens/s against ideal linear scaling.

Each worker is a Ray actor with ``model.simulate`` (default preset ``llama-8b-h100``: it sleeps
the modelled step time of an 8B model on one H100 and returns hash logits on the tiny model's
vocabulary, through the real sampler). Every worker gets the same load (``--rows`` running
rows, twice that many seeded requests of ``--max-tokens`` tokens, ignore_eos), so ideal
scaling is the one-worker rate times the workers.

Every shape runs twice, synchronous and pipelined (``scheduler.async_scheduling``: each
worker launches its next forward before the next plan arrives), on the same load, so the
two schedules are identical step for step. Figures for every run:
- **as measured** here, where every process (coordinator, workers, Ray) shares this machine's
  cores, which a GPU node with a core per GPU does not; against linear from one worker, and
  against the rate the modelled compute alone allows (the synchronous run's modelled step
  times: what the load needs);
- **own core**: the rate if every process had a core of its own (``cluster.engine.step_profile``: the
  coordinator's CPU on the critical path, an idle actor round trip, each worker's host CPU and
  modelled compute; in the pipelined step planning overlaps the forward launched ahead). CPU
  times are per thread (``time.thread_time``), which contention does not stretch.

Runs: one engine with 1..16 workers over plain actor calls; k engines x W workers with
k*W = 16; one engine over a Ray compiled graph (its channels busy-wait, so on a small machine
it is shown as measured only: the spin is CPU time, the own-core model cannot separate it).
Prints a table with where each step's time goes, and draws the curves against ideal
scaling in ``--plot`` (PNG).

    python bench/scale_out.py [--workers 1,4,16] [--engines 2,4,8,16] [--compiled 1,2,4]
                              [--modes sync,pipelined] [--rows 64] [--max-tokens 64]
                              [--plot bench/scale_out.png] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from cluster import Engine  # noqa: E402
from processors import SamplingParams  # noqa: E402

TOTAL_WORKERS = 16


@dataclass
class Run:
    engines: int
    workers: int  # per engine
    compiled: bool
    pipelined: bool
    tokens: int
    seconds: float
    profiles: list[dict[str, float]]  # per engine, over the timed run
    round_trip_s: float
    calls_cpu_s: float  # CPU of sending one small call to each of an engine's workers and collecting them
    tp: int = 1  # ranks per worker (model.tensor_parallel_size)

    @property
    def label(self) -> str:
        kind = "compiled graph" if self.compiled else "actor calls"
        return f"{self.engines} x {self.workers:>2}, {kind}, {'pipelined' if self.pipelined else 'sync'}"

    @property
    def shape(self) -> tuple[int, int, bool]:
        return self.engines, self.workers, self.compiled

    @property
    def total_workers(self) -> int:
        return self.engines * self.workers

    def rate(self) -> float:
        return self.tokens / self.seconds

    def own_core_seconds(self, profile: dict[str, float]) -> float:
        return profile["own_core_s"]

    def compute_seconds(self) -> float:
        """Modelled compute of the slowest engine's steps (engines run side by side)."""
        return max(p["simulated_s"] for p in self.profiles)

    def own_core_rate(self) -> float:
        """Engines run side by side, each on cores of its own: the slowest one sets the time."""
        return self.tokens / max(self.own_core_seconds(p) for p in self.profiles)

    def per_step_ms(self) -> dict[str, float]:
        """Where a step goes, averaged over every engine's steps."""
        steps = sum(p["steps"] for p in self.profiles)

        def ms(key: str) -> float:
            return 1000 * sum(p[key] for p in self.profiles) / steps

        parts = {"step (as measured)": ms("wall_s"), "coordinator CPU": ms("coordinator_cpu_s"),
                 "fan-out + gather": 1000 * self.round_trip_s, "slowest worker CPU": ms("worker_cpu_s"),
                 "modelled compute": ms("simulated_s"), "of it ahead": ms("ahead_s"),
                 "worker CPU overlapped": ms("overlap_cpu_s"),
                 "replicas updated, during forward": ms("update_cpu_s"), "stragglers": ms("straggler_s")}
        own = sum(self.own_core_seconds(p) for p in self.profiles) / steps * 1000
        parts["coord.: W calls"] = 1000 * self.calls_cpu_s
        parts["own-core step"] = own
        parts["contention"] = parts["step (as measured)"] - own
        return parts


def profiles_of(engine: object) -> list[dict[str, float]]:
    stats = engine.stats()
    return [e["profile"] for e in stats["engines"]] if "engines" in stats else [stats["profile"]]


def idle_round_trip(engine: object, calls: int = 50) -> float:
    """Median seconds of a small actor call to a worker while the engine is idle."""
    worker = engine.worker_handles()[0]
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        ray.get(worker.ready.remote())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calls_cpu(workers: list, rounds: int = 30) -> float:
    """Median CPU seconds of this thread to send one call to every worker and collect the answers: the
    part of the coordinator's step that grows with its workers whatever it plans."""
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        ray.get([w.ready.remote() for w in workers])
        times.append(time.thread_time() - start)
    return statistics.median(times)


def run(engines: int, workers: int, rows: int, max_tokens: int, preset: str, compiled: bool, pipelined: bool,
        tp: int = 1) -> Run:
    config = {
        "model": {"tiny": "default", "max_model_len": 256, "simulate": {"preset": preset}, "tensor_parallel_size": tp},
        "cluster": {"num_workers": workers, "num_engines": engines, "cpus_per_worker": 1, "compiled_graph": compiled,
                    "coordinator_name": f"scale-{engines}x{workers}x{tp}{'-cg' if compiled else ''}-{int(pipelined)}"},
        "scheduler": {"max_num_seqs": rows * workers, "max_num_batched_tokens": 64 * rows * workers,
                      "async_scheduling": pipelined},
    }
    engine = Engine.from_config(config)
    try:
        engine.generate(["warm up"] * engines * workers, SamplingParams(max_tokens=4))
        round_trip = idle_round_trip(engine)
        fan_out = calls_cpu(engine.worker_handles()[:workers])
        n = 2 * rows * workers * engines
        prompts = [f"request {i} of the scaling run" for i in range(n)]
        params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True)
                  for i in range(n)]
        before = profiles_of(engine)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        after = profiles_of(engine)
    finally:
        engine.shutdown()
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return Run(engines, workers, compiled, pipelined, sum(len(o.outputs[0].token_ids) for o in outs), seconds, delta,
               round_trip, fan_out, tp)


def tensor_parallel_report(runs: list[Run]) -> None:
    """The same GPUs as more workers or as wider groups: each group holds tp x the rows (its KV is
    spread over tp GPUs), so every shape runs the same requests."""
    base = next(r for r in runs if r.tp == 1)
    print(f"\n{TOTAL_WORKERS} simulated GPUs as workers x tensor-parallel ranks (pipelined step, actor calls)")
    print(f"{'workers x TP':<14} {'tokens/s':>9} {'vs 16x1':>8} {'own core':>9} {'vs 16x1':>8} {'compute only':>13} "
          f"{'vs 16x1':>8} {'compute ms/step':>16} {'step ms':>8}")
    for r in runs:
        compute_rate = r.tokens / r.compute_seconds()
        base_compute = base.tokens / base.compute_seconds()
        steps = sum(p["steps"] for p in r.profiles)
        print(f"{f'{r.workers} x {r.tp}':<14} {r.rate():9.0f} {r.rate() / base.rate():8.2f} {r.own_core_rate():9.0f} "
              f"{r.own_core_rate() / base.own_core_rate():8.2f} {compute_rate:13.0f} {compute_rate / base_compute:8.2f} "
              f"{1000 * r.compute_seconds() / steps:16.2f} {1000 * r.seconds / steps:8.2f}")


def base_of(runs: list[Run], r: Run) -> Run:
    """The one-worker run of the same kind (transport and mode): linear scaling starts there."""
    return next(b for b in runs if b.engines == 1 and b.workers == 1 and b.compiled == r.compiled
                and b.pipelined == r.pipelined)


def compute_only_s(runs: list[Run], r: Run) -> float:
    """Seconds the load needs at the modelled compute alone: the synchronous run's modelled steps
    (one forward a step, the same schedule); a pipelined run's own when no synchronous one ran."""
    sync = [s for s in runs if s.shape == r.shape and not s.pipelined]
    return (sync[0] if sync else r).compute_seconds()


def report(runs: list[Run]) -> None:
    print(f"\n{'run (engines x workers)':<44} {'tokens/s':>9} {'as measured':>12} {'own core':>9} {'vs compute':>11}")
    print(f"{'':<44} {'':>9} {'(fraction of linear from 1 worker)':>33} "
          "(as measured, against the rate the modelled compute alone allows)")
    for r in runs:
        base = base_of(runs, r)
        ideal_measured = base.rate() * r.total_workers
        ideal_own = base.own_core_rate() * r.total_workers
        own = "n/a (spin)" if r.compiled else f"{r.own_core_rate() / ideal_own:9.1%}"
        vs_compute = compute_only_s(runs, r) / r.seconds
        print(f"{r.label:<44} {r.rate():9.0f} {r.rate() / ideal_measured:12.1%} {own:>9} {vs_compute:11.1%}")
    print("\nwhere a step goes, ms (averaged over engines' steps)")
    keys = list(runs[0].per_step_ms())
    print(f"{'run':<44} " + " ".join(f"{k:>21}" for k in keys))
    for r in runs:
        print(f"{r.label:<44} " + " ".join(f"{v:21.2f}" for v in r.per_step_ms().values()))


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = [r for r in runs if r.total_workers == TOTAL_WORKERS and not r.compiled and r.engines > 1]
    if many:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    else:  # no runs split into engines: the one-engine curves alone
        fig, left = plt.subplots(1, 1, figsize=(6, 4.2))
    for pipelined, mark in ((False, "o"), (True, "s")):
        one = [r for r in runs if r.engines == 1 and not r.compiled and r.pipelined == pipelined]
        if not one:
            continue
        mode = "pipelined" if pipelined else "sync"
        xs = [r.workers for r in one]
        left.plot(xs, [r.own_core_rate() for r in one], mark + "-", label=f"{mode}: own core per process")
        left.plot(xs, [r.rate() for r in one], mark + ":", label=f"{mode}: as measured (2-core VM)")
    ideal = [r for r in runs if r.engines == 1 and not r.compiled and not r.pipelined]
    if ideal:
        xs = [r.workers for r in ideal]
        per_worker = compute_only_s(runs, ideal[0]) and ideal[0].tokens / compute_only_s(runs, ideal[0])
        left.plot(xs, [per_worker * x for x in xs], "k--", label="ideal: the modelled compute alone")
        left.set_xticks(xs, [str(x) for x in xs])
    left.set(xlabel="simulated H100 workers in one engine", ylabel="tokens/s", title="One engine",
             xscale="log", yscale="log")
    left.legend(fontsize=7)
    if many:
        labels = [f"{r.engines}x{r.workers}{' p' if r.pipelined else ''}" for r in many]
        at = range(len(many))
        right.bar([i - 0.2 for i in at],
                  [r.own_core_rate() / (base_of(runs, r).own_core_rate() * 16) for r in many], 0.4, label="own core")
        right.bar([i + 0.2 for i in at], [r.rate() / (base_of(runs, r).rate() * 16) for r in many], 0.4,
                  label="as measured")
        right.axhline(1.0, color="k", linestyle="--", linewidth=1)
        right.set_xticks(list(at), labels)
        right.set(xlabel="engines x workers (16 workers; p: pipelined)", ylabel="fraction of linear",
                  title="16 workers", ylim=(0, 1.1))
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,4,16", help="workers in one engine")
    parser.add_argument("--engines", default="2,4,8,16", help="engines k, each with 16/k workers")
    parser.add_argument("--compiled", default="1,2,4", help="workers in one engine over a compiled graph")
    parser.add_argument("--modes", default="sync,pipelined", help="sync, pipelined or both (the same load each)")
    parser.add_argument("--rows", type=int, default=64, help="rows per worker")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--preset", default="llama-8b-h100")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the curves")
    parser.add_argument("--tp", default="", help="instead: 16 GPUs as 16/tp workers x tp ranks, e.g. 1,2,4,8")
    parser.add_argument("--quick", action="store_true",
                        help="1 worker sync and pipelined, then 2 engines x 1 pipelined, 8 rows, 8 tokens (a smoke run)")
    args = parser.parse_args()
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: .venv/bin/pip install -e '.[bench]'")
    modes = [{"sync": False, "pipelined": True}[m] for m in args.modes.split(",") if m]
    if args.tp:
        ray.init(address="local", num_cpus=TOTAL_WORKERS + 2, include_dashboard=False, namespace="raysample",
                 log_to_driver=False)
        print(f"simulated {args.preset} ranks; {args.rows} rows per GPU, {args.max_tokens} tokens a request")
        tp_runs = []
        try:
            for tp in (int(t) for t in args.tp.split(",") if t):
                r = run(1, TOTAL_WORKERS // tp, args.rows * tp, args.max_tokens, args.preset, False, True, tp=tp)
                tp_runs.append(r)
                print(f"{r.workers} x {r.tp}: {r.tokens} tokens in {r.seconds:.1f} s = {r.rate():.0f} tokens/s", flush=True)
        finally:
            ray.shutdown()
        tensor_parallel_report(tp_runs)
        return
    if args.quick:  # each schedule on one worker, then the pipelined one on 2 engines: 4 engines started in all
        plan = [(1, 1, False, False), (1, 1, False, True), (2, 1, False, True)]
        rows, max_tokens = 8, 8
    else:
        shapes = [(1, int(w), False) for w in args.workers.split(",") if w]
        shapes += [(int(k), TOTAL_WORKERS // int(k), False) for k in args.engines.split(",") if k]
        shapes += [(1, int(w), True) for w in args.compiled.split(",") if w]
        plan = [(k, w, compiled, pipelined) for k, w, compiled in shapes for pipelined in modes]
        rows, max_tokens = args.rows, args.max_tokens
    ray.init(address="local", num_cpus=max(k * w for k, w, _, _ in plan) + 2, include_dashboard=False,
             namespace="raysample", log_to_driver=False)
    print(f"simulated {args.preset} workers, {rows} rows each, {max_tokens} tokens a request, "
          f"{2 * rows} requests per worker")
    runs: list[Run] = []
    try:
        for engines, workers, compiled, pipelined in plan:
            r = run(engines, workers, rows, max_tokens, args.preset, compiled, pipelined)
            runs.append(r)
            print(f"{r.label}: {r.tokens} tokens in {r.seconds:.1f} s = {r.rate():.0f} tokens/s "
                  f"(own core {r.own_core_rate():.0f})", flush=True)
    finally:
        ray.shutdown()
    report(runs)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()

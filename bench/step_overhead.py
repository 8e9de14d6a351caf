"""Per-step orchestration overhead of the Ray deployment, for 1, 2 and 4 CPU workers.

Overhead = the wall time of one step of the coordinator's loop (plan, send to
every worker, gather, take the tokens) minus the slowest worker's own compute
in that step; building and publishing outputs overlaps the next step. The
model is the "micro" tiny model (one layer, hidden 32), so compute is small
and the orchestration shows; on this 2-core machine, 4 CPU workers still
share 2 cores, so part of what 4 workers show is waiting for a core.
Reference: the same step loop in one process (LocalEngine), where the
overhead is the coordinator's own Python work. Prints median ms/step, with
the plan sent by plain actor calls (the default for CPU workers) and through
a Ray compiled graph (the default for GPU workers).

Then the scaling curve where compute dominates: generated tokens/s of the Ray
engine on the "bench" model (hidden 512, 4 layers) for the same worker counts,
each worker given an equal share of the machine's cores (``cpus_per_worker``),
as a ratio to one worker measured in the same run, again for both transports.
A compiled graph's channels busy-wait on the coordinator and on every worker,
so on CPU workers it takes cores from the model: its lower overhead per step
costs more compute than it saves. The same holds, more mildly, for building
outputs during the step: with no core left for the coordinator it slows the
worker, which is why the engine overlaps only on a spare core.

    python bench/step_overhead.py [--workers 1 2 4] [--requests 32] [--tokens 64] [--curve-requests 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from cluster import Engine  # noqa: E402
from cluster.config import resolve  # noqa: E402
from cluster.engine.local_engine import LocalEngine  # noqa: E402
from processors import SamplingParams  # noqa: E402


def config(workers: int, name: str, compiled: bool) -> dict:
    return {
        "model": {"tiny": "micro", "max_model_len": 256},
        "cluster": {"num_workers": workers, "coordinator_name": name, "compiled_graph": compiled},
        "scheduler": {"max_num_seqs": 32},
    }


def local_overhead_ms(workers: int, prompts: list[str], params: SamplingParams) -> float:
    engine = LocalEngine(config(workers, "local", False))
    overheads = []
    engine.submit_many(prompts, params)
    while engine.has_unfinished():
        start = time.perf_counter()
        plan = engine.coordinator.next_plan()
        if plan is None:
            break
        results = [w.step(plan) for w in engine.workers]
        engine.coordinator.accept_step(plan, results)
        engine.coordinator.take_outputs()
        compute = sum(r.timings.compute_s for r in results)  # in one process the workers run one after another
        overheads.append((time.perf_counter() - start - compute) * 1000)
    return statistics.median(overheads)


@ray.remote(num_cpus=0)
class _NoOp:
    def step(self, plan: object) -> object:
        return plan


def bare_round_trip_ms(workers: int, compiled: bool, calls: int = 200) -> float:
    """What the transport alone costs: one small message to ``workers`` no-op actors and back."""
    actors = [_NoOp.remote() for _ in range(workers)]
    ray.get([a.step.remote(0) for a in actors])
    graph = None
    if compiled:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            graph = MultiOutputNode([a.step.bind(plan) for a in actors]).experimental_compile()

    def once() -> float:
        start = time.perf_counter()
        if graph is not None:
            ray.get(graph.execute(0))
        else:
            ray.get([a.step.remote(0) for a in actors])
        return time.perf_counter() - start

    try:
        for _ in range(20):
            once()
        return statistics.median(once() for _ in range(calls)) * 1000
    finally:
        if graph is not None:
            graph.teardown()
        for actor in actors:
            ray.kill(actor)


def ray_overhead_ms(workers: int, prompts: list[str], params: SamplingParams, compiled: bool) -> float:
    engine = Engine.from_config(config(workers, f"bench-{workers}-{compiled}", compiled))
    try:
        engine.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        before = engine.stats()["steps"]
        engine.generate(prompts, params)
        stats = engine.stats()
        assert stats["steps"] > before
        return stats["step_overhead_ms_median"]
    finally:
        engine.shutdown()


def overlap_ab_ms(workers: int, prompts: list[str], params: SamplingParams, overlap: bool) -> float:
    """The step loop (``StepLoop``) in this process over compiled-graph workers, with step N's
    outputs built while step N+1 runs (the engine's way) or after step N, before planning N+1."""
    from cluster.ray.step_loop import StepLoop

    StepLoop.overlap_outputs = overlap
    core = StepLoop(resolve(config(workers, f"overlap-{workers}-{overlap}", compiled=True)))
    try:
        core.add_requests([(p, params, None) for p in prompts[:2]])
        while core.core.coordinator.has_unfinished():
            time.sleep(0.01)
        core.core.step_overhead_ms.clear()
        ids = core.add_requests([(p, params, None) for p in prompts])
        while core.core.coordinator.has_unfinished():
            time.sleep(0.01)
        assert len(core.poll(ids, 5.0, finished_only=True)) > 0
        return statistics.median(core.core.step_overhead_ms)
    finally:
        StepLoop.overlap_outputs = None
        core.shutdown()


def overlap_ab_tokens_per_s(requests: int, cores: int, overlap: bool) -> float:
    """Tokens/s of the step loop in this process over one worker with every core (actor calls),
    bench model: does building outputs during the step pay when the worker's threads fill the cores?"""
    from cluster.ray.step_loop import StepLoop

    StepLoop.overlap_outputs = overlap
    core = StepLoop(resolve({
        "model": {"tiny": "bench", "max_model_len": 256},
        "cluster": {"num_workers": 1, "cpus_per_worker": cores, "coordinator_name": f"overlap-bench-{overlap}"},
        "scheduler": {"max_num_seqs": 64},
    }))
    try:
        prompts = [f"request {i}: " + "the quick brown fox " * (1 + i % 8) for i in range(requests)]
        params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
        start = time.perf_counter()
        waiting = set(core.add_requests([(p, params, None) for p in prompts]))
        tokens = 0
        while waiting:
            for out in core.poll(list(waiting), 1.0, finished_only=True):
                waiting.discard(out.request_id)
                tokens += len(out.token_ids)
        return tokens / (time.perf_counter() - start)
    finally:
        StepLoop.overlap_outputs = None
        core.shutdown()


def curve_tokens_per_s(workers: int, requests: int, cores: int, compiled: bool) -> float:
    """Tokens/s of the Ray engine on the bench model, the machine's cores split among the workers."""
    share = cores / workers
    engine = Engine.from_config({
        "model": {"tiny": "bench", "max_model_len": 256},
        "cluster": {"num_workers": workers, "cpus_per_worker": share, "compiled_graph": compiled,
                    "coordinator_name": f"curve-{workers}-{compiled}"},
        "scheduler": {"max_num_seqs": 64},
    })
    try:
        engine.generate(["warm up"], SamplingParams(max_tokens=4))
        prompts = [f"request {i}: " + "the quick brown fox " * (1 + i % 8) for i in range(requests)]
        params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--curve-requests", type=int, default=128, help="0 skips the bench-model curve")
    args = parser.parse_args()
    prompts = [f"request {i}: the quick brown fox" for i in range(args.requests)]
    params = SamplingParams(seed=1, max_tokens=args.tokens, ignore_eos=True)
    ray.init(address="local", num_cpus=max(args.workers) + 2, include_dashboard=False, namespace="raysample-bench",
             log_to_driver=False)
    print(f"{args.requests} requests x {args.tokens} tokens, tiny model, CPU workers; median ms over steps")
    print(f"{'workers':>7} {'in-process':>11} {'Ray, actor calls':>17} {'Ray, compiled graph':>20}"
          f"   bare round trip to no-op actors: {'calls':>6} {'graph':>6}")
    for workers in args.workers:
        local = local_overhead_ms(workers, prompts, params)
        calls = ray_overhead_ms(workers, prompts, params, compiled=False)
        graph = ray_overhead_ms(workers, prompts, params, compiled=True)
        bare_calls = bare_round_trip_ms(workers, compiled=False)
        bare_graph = bare_round_trip_ms(workers, compiled=True)
        print(f"{workers:>7} {local:>11.2f} {calls:>17.2f} {graph:>20.2f}"
              f"   {'':>32} {bare_calls:>6.2f} {bare_graph:>6.2f}", flush=True)
    print("compiled graph, step loop in this process: outputs built while the next step runs vs after each step")
    print(f"{'workers':>7} {'overlapped':>11} {'after the step':>15} {'saved':>6}")
    for workers in args.workers:
        after = overlap_ab_ms(workers, prompts, params, overlap=False)
        overlapped = overlap_ab_ms(workers, prompts, params, overlap=True)
        print(f"{workers:>7} {overlapped:>11.2f} {after:>15.2f} {after - overlapped:>6.2f}", flush=True)
    if args.curve_requests:
        cores = len(os.sched_getaffinity(0))
        print(f"bench model, 1 worker x {cores} cores (no core left for the coordinator), actor calls, "
              "outputs built while the next step runs vs after each step; alternating, best of 2")
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(2):
            for overlap in (False, True):
                runs[overlap].append(overlap_ab_tokens_per_s(args.curve_requests, cores, overlap))
        best = {k: max(v) for k, v in runs.items()}
        print(f"overlapped {best[True]:.0f} tokens/s, after each step {best[False]:.0f}: "
              f"{best[True] / best[False]:.2f}x (the engine overlaps only with a spare core)", flush=True)
        print(f"bench model, {args.curve_requests} requests x 96 tokens, greedy, {cores} cores split among the workers")
        print(f"{'workers':>7} {'actor calls tok/s':>18} {'vs 1 worker':>12} {'compiled graph tok/s':>21} "
              f"{'calls / graph':>14}")
        first = None
        for workers in args.workers:
            calls = curve_tokens_per_s(workers, args.curve_requests, cores, compiled=False)
            graph = curve_tokens_per_s(workers, args.curve_requests, cores, compiled=True)
            first = first or calls
            print(f"{workers:>7} {calls:>18.0f} {calls / first:>11.2f}x {graph:>21.0f} {calls / graph:>13.2f}x",
                  flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()

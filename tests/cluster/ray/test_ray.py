"""The engine on Ray: same outputs as in one process, audit, fault tolerance, attach by name.

One Ray cluster (``ray.cluster_utils.Cluster``, a head node plus, for one
test, a second simulated node) is shared by every test here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray
from helpers import FaultAfterFirstResults, pythonpath
from ray.cluster_utils import Cluster

from cluster import Engine, EngineError
from cluster.engine.local_engine import LocalEngine
from coordinator.request import FinishReason
from processors import SamplingParams
from workers.step.threads import usable_cores

PROMPTS = [
    "a b c a b c a b c",
    "The quick brown fox jumps over the lazy dog",
    "Hello <think>",
    "café 你好",
    "1 2 3 1 2 3",
    "Logits processors steer generation",
]


def base_config(**overrides) -> dict:
    config = {
        "model": {"tiny": "default", "max_model_len": 160},
        "scheduler": {"max_num_seqs": 4, "consistency_check_every": 1},
        "processors": ["processors.examples:DummyLogitsProcessor", "processors.examples:WrappedPerReqLogitsProcessor"],
        "speculative": {"num_speculative_tokens": 3, "draft_policy": "fixed"},
        "reasoning": {"start": "<think>", "end": "Final answer:"},
        "cluster": {"call_timeout_s": 60},
    }
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def workload() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(seed=11, temperature=0.9, top_k=50, max_tokens=24, ignore_eos=True),
        SamplingParams(seed=12, max_tokens=26, ignore_eos=True, thinking_token_budget=5),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, extra_args={"target_token": 77}),
        SamplingParams(seed=13, max_tokens=28, ignore_eos=True, min_p=0.05, extra_args={"target_token": 5}),
        SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True, logit_bias={9: 2.0}),
    ]


@pytest.fixture(scope="module")
def ray_cluster():
    # Metrics reach the node's Prometheus endpoint every 0.5 s instead of Ray's default 10 s.
    tests_dir = str(Path(__file__).resolve().parents[2] / "support")  # test-only processors, importable in actors
    # Through the environment the nodes inherit (the second node's too), not a runtime_env: with one, every
    # actor starts through Ray's setup_worker.py, a second interpreter that imports Ray again.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", pythonpath(tests_dir))
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 8, "_system_config": {"metrics_report_interval_ms": 500}})
        ray.init(address=cluster.address, namespace="raysample-tests")
        yield cluster
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def in_process_reference():
    engine = LocalEngine(base_config(cluster={"num_workers": 1}, scheduler={"consistency_check_every": 0}))
    return [o.token_ids for o in engine.generate(PROMPTS, workload())]


def start(name: str, **overrides) -> Engine:
    return Engine.from_config(base_config(cluster={"coordinator_name": name, **overrides.pop("cluster", {})}, **overrides))


SIMULATED = {"simulate": {"fixed_ms": 2.0, "per_token_ms": 0.02}}


@pytest.fixture(scope="module")
def simulated_reference():
    engine = LocalEngine(base_config(model=SIMULATED, cluster={"num_workers": 1}, scheduler={"consistency_check_every": 0}))
    return [o.token_ids for o in engine.generate(PROMPTS, workload())]


@pytest.mark.parametrize("workers", [2, 4])
def test_simulated_workers_on_actors_match_the_in_process_engine(ray_cluster, simulated_reference, workers):
    """Workers that sleep a modelled GPU step instead of computing (model.simulate), through the real
    sampler, processors, spec decode and audit: the tokens are the in-process engine's."""
    engine = start(f"simulated-{workers}", model=SIMULATED, cluster={"num_workers": workers})
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, workload())] == simulated_reference
        assert engine.stats()["workers_alive"] == workers
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("workers", "tight", "compiled"), [(4, False, True), (2, True, "auto")])
def test_workers_match_in_process_engine(ray_cluster, in_process_reference, workers, tight, compiled):
    """Tight: 8 blocks of 8 tokens per worker (one sequence of max_model_len=64, every request fits
    in it) for 2 rows each: requests are preempted and recomputed, with the audit every step.
    The plan goes out through a compiled graph, then by actor calls (the CPU default)."""
    extra = {"model": {"max_model_len": 64}, "cache": {"block_size": 8, "kv_cache_memory": 8 * 2 * 2 * 8 * 2 * 16 * 4}}
    engine = start(f"match-{workers}", cluster={"num_workers": workers, "compiled_graph": compiled},
                   **(extra if tight else {}))
    try:
        outputs = engine.generate(PROMPTS, workload())
        assert [o.token_ids for o in outputs] == in_process_reference
        stats = engine.stats()
        assert stats["workers_alive"] == workers and stats["error"] is None
        assert stats["overlap_outputs"] == (usable_cores() - workers >= 1)  # one thread per worker
        assert stats["steps"] > 20  # audited every step
        assert (stats["preemptions"] > 0) == tight, stats
        params = SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=8, ignore_eos=True)
        pair = engine.generate("Hello", params)[0]
        local = LocalEngine(base_config(cluster={"num_workers": 1})).generate("Hello", params)[0]
        assert [c.token_ids for c in pair.outputs] == [c.token_ids for c in local.outputs]
        assert pair.outputs[0].token_ids != pair.outputs[1].token_ids
    finally:
        engine.shutdown()


def test_killed_worker_mid_generation_loses_nothing_and_a_second_driver_attaches_by_name(ray_cluster):
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True) for _ in PROMPTS]
    reference = [o.token_ids for o in LocalEngine(base_config()).generate(PROMPTS, params)]
    engine = start("kill", cluster={"num_workers": 2})
    try:
        ids = engine.submit_many(PROMPTS, params)
        seen: dict[str, int] = {}
        while sum(seen.values()) < 40:  # let generation get going
            for out in engine.poll(ids, 1.0):
                seen[out.request_id] = len(out.token_ids)
        ray.kill(engine.worker_handles()[0])
        final = engine.results(ids)
        assert [final[i].token_ids for i in ids] == reference
        assert all(final[i].finish_reason == FinishReason.LENGTH for i in ids)
        stats = engine.stats()
        assert stats["recoveries"] == 1 and stats["workers_alive"] == 2  # the dead one was replaced
        after = engine.generate("Hello", params[0])[0]  # still serving
        assert len(after.token_ids) == 60 and after.error is None
        # Another driver attaches to the engine by its name and gets what this one gets.
        script = textwrap.dedent(
            f"""
            import json, ray
            from cluster import Engine
            from processors import SamplingParams
            ray.init(address={ray_cluster.address!r}, namespace="raysample-tests")
            engine = Engine.connect("kill", "raysample")
            out = engine.generate("Hello", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))[0]
            print(json.dumps(out.token_ids))
            """
        )
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == after.token_ids
    finally:
        engine.shutdown()


def test_a_hung_worker_is_killed_and_replaced_with_compiled_graphs(ray_cluster):
    """SIGSTOP one worker mid-generation (compiled graph on): the step times out, every worker is
    stopped and replaced, and the requests finish exactly as without the fault."""
    import signal

    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in PROMPTS[:4]]
    reference = [o.token_ids for o in LocalEngine(base_config()).generate(PROMPTS[:4], params)]
    engine = start("hung", cluster={"num_workers": 2, "call_timeout_s": 8, "compiled_graph": True})
    pid = None
    try:
        ids = engine.submit_many(PROMPTS[:4], params)
        engine.poll(ids, 5.0)
        pid = ray.get(engine.worker_handles()[0].pid.remote())
        os.kill(pid, signal.SIGSTOP)
        final = engine.results(ids)
        assert [final[i].token_ids for i in ids] == reference
        stats = engine.stats()
        assert stats["recoveries"] == 1 and stats["workers_alive"] == 2
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed by the engine, as it should be
        engine.shutdown()


def test_node_removed_on_two_node_cluster(ray_cluster):
    node = ray_cluster.add_node(num_cpus=2)
    ray_cluster.wait_for_nodes()
    params = [SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True) for _ in PROMPTS]
    reference = [o.token_ids for o in LocalEngine(base_config()).generate(PROMPTS, params)]
    # No replacement: STRICT_SPREAD has no second node left to put one on.
    engine = start("two-nodes", cluster={"num_workers": 2, "placement_strategy": "STRICT_SPREAD",
                                         "max_worker_replacements": 0})
    try:
        ids = engine.submit_many(PROMPTS, params)
        engine.poll(ids, 5.0)
        ray_cluster.remove_node(node)
        final = engine.results(ids)
        assert [final[i].token_ids for i in ids] == reference
        assert engine.stats()["recoveries"] >= 1
    finally:
        engine.shutdown()


def test_metrics_reach_rays_prometheus_endpoint_then_stream_abort_and_engine_errors_surface(ray_cluster):
    import asyncio

    engine = start("stream", cluster={"num_workers": 1, "cpus_per_worker": 1})
    try:
        [worker] = engine.worker_handles()  # intra-op threads from its CPU share (1), not the host's cores
        assert ray.get(worker.__ray_call__.remote(lambda self: __import__("torch").get_num_threads())) == 1
        outs = engine.generate(PROMPTS[:4], workload()[:4])
        stats = engine.stats()
        generated = sum(len(o.token_ids) for o in outs)
        assert stats["generated_tokens"] == generated and stats["tokens_per_s"] > 0
        deadline, samples = time.monotonic() + 60, {}
        while time.monotonic() < deadline:  # a last step may still drop finished rows from the workers
            samples, stats = scrape("stream"), engine.stats()
            # Each metric reaches the endpoint on its own export tick: wait until every one compared is current.
            if (samples.get("ray_raysample_generated_tokens_total") == generated
                    and samples.get("ray_raysample_step_seconds_count") == stats["steps"]
                    and samples.get("ray_raysample_spec_proposed_tokens_total") == stats["spec_proposed"]
                    and samples.get("ray_raysample_spec_accepted_tokens_total") == stats["spec_accepted"]
                    and samples.get("ray_raysample_requests_finished_total{length}") == 4):
                break
            time.sleep(0.5)
        assert samples.get("ray_raysample_generated_tokens_total") == generated, samples
        assert samples["ray_raysample_requests_finished_total{length}"] == 4
        assert samples["ray_raysample_spec_proposed_tokens_total"] == stats["spec_proposed"] > 0
        assert samples["ray_raysample_spec_accepted_tokens_total"] == stats["spec_accepted"]
        assert samples["ray_raysample_prefill_tokens_total"] >= sum(len(o.prompt_token_ids) for o in outs)
        assert samples["ray_raysample_step_seconds_count"] == stats["steps"]
        for gauge in ("requests_running", "requests_waiting", "kv_cache_usage", "generation_tokens_per_second"):
            assert f"ray_raysample_{gauge}" in samples

        # A core left for the coordinator: step N's outputs are built while step N+1 runs.
        assert engine.stats()["overlap_outputs"] == (usable_cores() >= 2)
        async def collect():
            return [out async for out in engine.stream("Hello", SamplingParams(seed=3, max_tokens=12, ignore_eos=True))]

        outs = asyncio.run(collect())
        assert outs[-1].finished and len(outs[-1].token_ids) == 12
        assert "".join(o.new_text for o in outs) == outs[-1].text
        assert len(outs) > 1 and not any(o.finished for o in outs[:-1])  # pushed step by step, not at the end

        async def first_two():
            got = []
            async for out in engine.stream("Hello", SamplingParams(seed=4, max_tokens=150, ignore_eos=True)):
                got.append(out)
                if len(got) == 2:
                    break  # the consumer goes away: the request is aborted, not left running
            return got

        aborted_before = engine.stats()["finished"].get("abort", 0)
        assert len(asyncio.run(first_two())) == 2
        assert engine.stats()["finished"].get("abort", 0) == aborted_before + 1
        rid = engine.submit("Hello", SamplingParams(seed=1, max_tokens=150, ignore_eos=True))
        time.sleep(0.3)
        assert engine.abort(rid)
        assert engine.results([rid])[rid].finish_reason == FinishReason.ABORT
        bad = engine.generate("Hello", SamplingParams(logit_bias={10**6: 1.0}))[0]
        assert bad.finish_reason == FinishReason.ERROR and "outside the vocabulary" in bad.error
        with pytest.raises(EngineError, match="unknown request id"):
            engine.poll(["nope"], 0.1)
    finally:
        engine.shutdown()


def test_a_failing_processor_fails_only_its_requests_on_ray(ray_cluster):
    from failing_processors import BoomAdapter

    processors = [BoomAdapter, "failing_processors:BoomV2"]  # a class object travels to the actors too
    extra = {"processors": processors, "speculative": None, "reasoning": None}
    params = [SamplingParams(seed=i, temperature=0.8, max_tokens=12, ignore_eos=True) for i in range(len(PROMPTS))]
    clean = LocalEngine(base_config(cluster={"num_workers": 1}, **extra)).generate(PROMPTS, params)
    tagged = {0: "apply", 3: "v2"}
    for i, tag in tagged.items():
        params[i] = SamplingParams(max_tokens=5, extra_args={"boom": tag})
    engine = start("boom", cluster={"num_workers": 2, "compiled_graph": True}, **extra)  # kill: actor calls
    try:
        outs = engine.generate(PROMPTS, params)
        for i, (out, ref) in enumerate(zip(outs, clean)):
            if i in tagged:
                assert out.error and "exploded" in out.error, out.error
            else:
                assert out.error is None and out.token_ids == ref.token_ids, i
        assert engine.stats()["error"] is None
    finally:
        engine.shutdown()


def test_one_request_never_takes_down_another_on_ray(ray_cluster):
    """NaN logits, a processor that fails steps without naming its request, one that hangs for a minute
    and one whose request kills the worker's process: only those four requests fail; the others
    finish exactly as in a clean run, and finding the culprits uses up no worker replacement."""
    processors = ["failing_processors:NonFinite", "failing_processors:BoomLate",
                  "failing_processors:HangsAtThirdToken", "failing_processors:ExitsAtThirdToken"]
    extra = {"processors": processors, "speculative": None, "reasoning": None}
    params = [SamplingParams(seed=i, temperature=0.8 if i % 2 else 0.0, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS))]
    clean = [o.token_ids for o in LocalEngine(base_config(cluster={"num_workers": 1}, **extra)).generate(PROMPTS, params)]
    culprits = [SamplingParams(max_tokens=20, extra_args=extra_args) for extra_args in
                ({"boom": "nan"}, {"boom": "late"}, {"hang": True}, {"exit": True})]
    engine = start("isolation", cluster={"num_workers": 2, "call_timeout_s": 4, "max_worker_replacements": 2},
                   scheduler={"max_num_seqs": 10}, **extra)
    try:
        outs = engine.generate(PROMPTS + [f"culprit {i}" for i in range(4)], params + culprits)
        for i, out in enumerate(outs[: len(PROMPTS)]):
            assert out.error is None and out.token_ids == clean[i], (i, out.error)
        nan, late, hang, dies = outs[len(PROMPTS):]
        assert "its logits contain NaN after logits processor failing_processors.NonFinite" in nan.error
        assert "made the engine fail on its own" in late.error and "does not name" in late.error
        assert "made the engine fail on its own" in hang.error and "a worker hung" in hang.error
        assert "made the engine fail on its own" in dies.error and "a worker died" in dies.error
        assert not any(o.retryable for o in outs)
        stats = engine.stats()
        assert stats["error"] is None and stats["workers_alive"] == 2
        assert engine.generate(PROMPTS[0], params[0])[0].token_ids == clean[0]
    finally:
        engine.shutdown()


def scrape(engine_name: str) -> dict[str, float]:
    """Ray's Prometheus endpoint on the head: raysample samples of one engine, name{finish_reason} -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = ray.nodes()[0]["MetricsExportPort"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_raysample_") and sample.labels.get("engine") == engine_name:
                reason = sample.labels.get("finish_reason")
                samples[sample.name + (f"{{{reason}}}" if reason else "")] = sample.value
    return samples


def test_several_engines_share_a_cluster_and_a_taken_name_is_a_clear_error(ray_cluster):
    config = base_config(cluster={"num_workers": 1}, speculative=None)
    config["cluster"].pop("coordinator_name", None)
    first, second = Engine.from_config(config), Engine.from_config(config)  # unique names by default
    try:
        assert first.name != second.name and first.name.startswith("raysample-")
        a, b = first.generate("Hello", workload()[0])[0], second.generate("Hello", workload()[0])[0]
        assert a.token_ids == b.token_ids
        with pytest.raises(EngineError, match=f"an engine named '{first.name}' already runs"):
            Engine.from_config(base_config(cluster={"num_workers": 1, "coordinator_name": first.name}))
        assert Engine.connect(first.name, "raysample").generate("Hello", workload()[0])[0].token_ids == a.token_ids
    finally:
        first.shutdown()
        second.shutdown()


def test_random_mixture_of_good_and_bad_lines_on_two_workers(ray_cluster, tmp_path):
    """The job's fuzz mixture on 2 Ray workers: every good line as in a clean run, one error record per bad line."""
    pytest.importorskip("logits_processor_zoo", reason="the optional 'zoo' extra is not installed")
    import fuzz_lines

    from cluster.config import load_config
    from cluster.entrypoints.job_runner import run_job

    config = load_config(fuzz_lines.config(workers=2))
    engine = Engine.from_config(config)
    try:
        lines, goods = fuzz_lines.mixture(3, good=14, bad=12)
        mixed = fuzz_lines.write(tmp_path / "mixed.jsonl", lines)
        counters = run_job(config, engine, mixed, tmp_path / "mixed-out.jsonl", max_in_flight=12)
        assert counters.done == len(goods) and counters.errors == len(lines) - len(goods)
        clean = fuzz_lines.write(tmp_path / "clean.jsonl", [json.dumps(g).encode() for g in goods])
        run_job(config, engine, clean, tmp_path / "clean-out.jsonl", max_in_flight=12)
        fuzz_lines.check(tmp_path / "mixed-out.jsonl", tmp_path / "clean-out.jsonl", lines, goods)
        assert engine.stats()["workers_alive"] == 2
    finally:
        engine.shutdown()


def test_every_worker_killed_fails_pending_requests_clearly_and_the_next_run_retries_them(ray_cluster, tmp_path):
    from cluster.config import load_config
    from cluster.entrypoints.job_runner import run_job

    def config(name: str):
        return load_config(base_config(cluster={"num_workers": 2, "max_worker_replacements": 0,
                                                "coordinator_name": name}, speculative=None))

    # Short and long requests: the first result (a short one) is polled while the long ones still run, however
    # late the job polls. With equal lengths a whole wave could finish before the first poll, leaving none running.
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": f"retry {i}", "sampling_params":
                                          {"max_tokens": 8 if i % 2 == 0 else 120, "ignore_eos": True,
                                           "temperature": 1.0}}) + "\n"
                              for i in range(12)))
    output = tmp_path / "out.jsonl"
    engine = Engine.from_config(config("retry-first"))

    def kill_every_worker() -> None:
        for handle in engine.worker_handles():
            ray.kill(handle)

    try:
        with pytest.raises((EngineError, RuntimeError), match="all raysample workers are gone"):
            run_job(config("retry-first"), FaultAfterFirstResults(engine, kill_every_worker), source, output,
                    max_in_flight=6)
        with pytest.raises(EngineError, match="all raysample workers are gone"):  # and it takes no more
            engine.submit("more", SamplingParams())
    finally:
        engine.shutdown()
    first = [json.loads(line) for line in output.read_text().splitlines()]
    done = {r["id"] for r in first if r["error"] is None}
    assert done and len(done) < 12, first  # some written before the workers died, not all
    # The requests running when they died failed clearly and are marked for a retry; lines submitted
    # after the engine stopped have no record yet.
    failed = [r for r in first if r["error"]]
    assert failed and all(r.get("retryable") and "all raysample workers are gone" in r["error"] for r in failed), first
    engine = Engine.from_config(config("retry-second"))
    try:
        run_job(config("retry-second"), engine, source, output, max_in_flight=6)
        clean = tmp_path / "clean.jsonl"
        run_job(config("retry-second"), engine, source, clean, max_in_flight=6)
    finally:
        engine.shutdown()
    newest = {}
    for record in map(json.loads, output.read_text().splitlines()):
        newest[record["id"]] = record
    reference = {r["id"]: r["token_ids"] for r in map(json.loads, clean.read_text().splitlines())}
    assert all(r["error"] is None for r in newest.values()) and len(newest) == 12
    assert {i: r["token_ids"] for i, r in newest.items()} == reference  # unseeded, yet as an uninterrupted run

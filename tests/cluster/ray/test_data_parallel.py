"""Past one engine: data-parallel engines (``cluster.num_engines``) and Ray Data datasets.

One Ray cluster and one 2-engine group are shared by the module; the reference is the JSONL
job on one in-process engine. Outputs are keyed by seed or request id, so they must not
depend on which engine (or Ray Data actor) ran a request, nor on one dying midway.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ray
from helpers import FaultAfterFirstResults, pythonpath

from cluster import Engine
from cluster.config import load_config
from cluster.engine.local_engine import LocalEngine
from cluster.entrypoints.job_runner import run_job
from cluster.ray.engine_group import EngineGroup

CONFIG = {
    "model": {"tiny": "default", "max_model_len": 192},
    "scheduler": {"max_num_seqs": 8},
    # NonFinite makes r7's logits NaN; BoomLate fails steps with r9 without naming it (the quarantine finds it).
    "processors": ["processors.examples:DummyLogitsProcessor", "failing_processors:NonFinite",
                   "failing_processors:BoomLate"],
    "cluster": {"num_workers": 1, "call_timeout_s": 60},
}


def lines() -> list[dict]:
    out = []
    for i in range(14):
        params = {"max_tokens": 24 + 5 * (i % 4), "ignore_eos": True}
        if i % 2:
            params |= {"seed": 100 + i, "temperature": 0.9, "top_p": 0.9}  # seeded
        else:
            params |= {"temperature": 1.0}  # unseeded: keyed by the request id
        if i == 5:
            params["n"] = 2
        line = {"id": f"r{i}", "prompt": f"request number {i} about data parallel engines", "sampling_params": params}
        if i == 6:
            line["extra_args"] = {"target_token": 42}
        if i in (7, 9):  # one request alone fails, however many engines there are; no one else does
            line["extra_args"] = {"boom": "nan" if i == 7 else "late"}
        out.append(line)
    out.append({"id": "bad", "prompt": "x", "sampling_params": {"temperature": -1}})
    return out


def comparable(path) -> dict:
    records = {}
    for record in map(json.loads, path.read_text().splitlines()):
        record.pop("timing", None)
        assert record["id"] not in records, f"{record['id']} written twice"
        records[record["id"]] = record
    return records


def assert_same_records(got: dict, want: dict) -> None:
    """Equal, but for the tokens a request that failed the engine (r9) had when it was convicted: how many
    depends on how many steps it ran before the fault fired (BoomLate counts its calls), so on its neighbours
    and on how its prompt was chunked (6 on the one in-process engine, 8 on one of two Ray engines, since steps
    are aimed at multiples of 8 rows). Those tokens must agree as far as both go."""
    assert got.keys() == want.keys()
    for rid, record in got.items():
        expected = want[rid]
        if record.get("error") and record.get("token_ids") and expected.get("token_ids"):
            record, expected = dict(record), dict(expected)
            tokens, wanted = record.pop("token_ids"), expected.pop("token_ids")
            both = min(len(tokens), len(wanted))
            assert tokens[:both] == wanted[:both], (rid, tokens, wanted)
            record.pop("text"), expected.pop("text")
        assert record == expected, rid


@pytest.fixture(scope="module")
def ray_cluster():
    tests_dir = str(Path(__file__).resolve().parents[2] / "support")
    # Test-only processors, importable in actors: through the environment the instance inherits, not a
    # runtime_env, with which every actor would start through Ray's setup_worker.py.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", pythonpath(tests_dir))
        ray.init(address="local", num_cpus=6, include_dashboard=False, namespace="raysample-dp-tests")
        yield
        ray.shutdown()


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp") / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines()))
    return path


GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "job_records.json"


@pytest.fixture(scope="module")
def reference(job_input, tmp_path_factory):
    """The job's records on one engine, in this process; they equal the ones recorded before the step
    loop was restructured (``RAYSAMPLE_RECORD_GOLDEN=1`` records them anew; no floats in them)."""
    output = tmp_path_factory.mktemp("dp-ref") / "out.jsonl"
    config = load_config(CONFIG)
    run_job(config, LocalEngine(config), job_input, output, max_in_flight=8)
    records = comparable(output)
    if os.environ.get("RAYSAMPLE_RECORD_GOLDEN"):
        GOLDEN.write_text(json.dumps(records, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    assert_same_records(records, json.loads(GOLDEN.read_text()))
    return records


@pytest.fixture(scope="module")
def group(ray_cluster):
    engines = Engine.from_config({**CONFIG, "cluster": {**CONFIG["cluster"], "num_engines": 2,
                                                        "coordinator_name": "dp"}})
    assert isinstance(engines, EngineGroup) and len(engines.engines) == 2
    yield engines
    engines.shutdown()


def test_two_engines_write_the_records_of_one(group, job_input, reference, tmp_path):
    output = tmp_path / "out.jsonl"
    counters = run_job(load_config(CONFIG), group, job_input, output, max_in_flight=16)
    assert_same_records(comparable(output), reference)
    assert counters.done == 12 and counters.errors == 3
    assert "its logits contain NaN after logits processor failing_processors.NonFinite" in reference["r7"]["error"]
    assert "made the engine fail on its own" in reference["r9"]["error"] and not reference["r9"].get("retryable")
    stats = group.stats()
    per_engine = [sum(s["finished"].values()) for s in stats["engines"]]
    assert all(n >= 4 for n in per_engine), per_engine  # both engines took a share
    assert stats["engines_alive"] == 2 and stats["generated_tokens"] == sum(s["generated_tokens"] for s in stats["engines"])
    assert stats["kv_cache"].startswith("2 engines: dp-0: KV cache")
    # One node, two engines: their workers' KV budgets were planned together, and Ray holds each worker's memory.
    assert stats["kv_cache"].count("once its 2 worker(s) hold their weights") == 2, stats["kv_cache"]
    per_worker = stats["engines"][0]["memory_per_worker"]
    assert per_worker and ray.cluster_resources()["memory"] - ray.available_resources()["memory"] >= 2 * per_worker


def test_a_killed_engine_loses_and_duplicates_nothing(group, job_input, reference, tmp_path):
    """Engine 1's coordinator is killed once the first records are written: its requests run on engine 0."""
    output = tmp_path / "out.jsonl"
    its_workers = list(group.engines[1]._workers)

    def kill_engine_1() -> None:
        assert any(t.engine == 1 for t in group._requests.values())  # it still holds requests
        ray.kill(group.engines[1]._actor)

    run_job(load_config(CONFIG), FaultAfterFirstResults(group, kill_engine_1), job_input, output, max_in_flight=16)
    assert_same_records(comparable(output), reference)
    stats = group.stats()
    assert stats["engines_alive"] == 1 and stats["engines"][1] is None and stats["reruns"] > 0
    for worker in its_workers:  # what the dead engine held was released
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.pid.remote(), timeout=30)


def test_more_engines_than_the_cluster_holds_fail_in_seconds(ray_cluster):
    with pytest.raises(RuntimeError, match=r"^64 engines x 1 workers x 1 CPU need 64 CPU; the Ray cluster has 6 "):
        Engine.from_config({**CONFIG, "cluster": {"num_engines": 64}})  # refused before anything is placed


# ----- Ray Data -----

def data_rows() -> list[dict]:
    """The job's lines as dataset rows (n=2 aside: a row holds one completion), and rows that cannot run."""
    rows = [line for line in lines() if line["id"] != "r5"]
    rows += [{"id": "no-prompt", "sampling_params": {"max_tokens": 4}},
             {"id": "n2", "prompt": "two of them", "sampling_params": {"n": 2}},
             {"id": "dup", "prompt": "first"}, {"id": "dup", "prompt": "second"}]
    return rows


def check_against_job(rows: list[dict], reference: dict) -> None:
    by_id: dict = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    for rid, record in reference.items():
        if rid in ("r5", "bad"):
            continue
        [row] = by_id[rid]
        if record["error"] is not None:  # the requests that fail alone (r7, r9): the same error
            assert row["error"] == record["error"], (row, record)
            continue
        assert row["error"] is None, row
        assert list(row["generated_token_ids"]) == record["token_ids"], rid
        assert (row["generated_text"], row["finish_reason"]) == (record["text"], record["finish_reason"])
        assert row["num_generated_tokens"] == len(record["token_ids"])
        assert row["num_input_tokens"] == record["prompt_tokens"]
    errors = {rid: rows[0]["error"] for rid, rows in by_id.items() if rid not in reference}
    assert errors["no-prompt"] == "give exactly one of 'prompt', 'prompt_token_ids' or 'messages'"
    assert errors["n2"].startswith("n=2: a dataset row holds one completion")
    assert by_id["bad"][0]["error"].startswith("invalid sampling_params: temperature")
    # Two rows of one id both run (in one batch or two: batches are cut anywhere), each on its own prompt.
    assert [r["error"] for r in by_id["dup"]] == [None, None] and all(r["generated_token_ids"] for r in by_id["dup"])


def test_ray_data_parquet_and_json_in_and_out_on_two_engines_one_of_which_crashes(ray_cluster, job_input,
                                                                                  reference, tmp_path):
    """Parquet and JSON in (one dataset), Parquet and JSON out, on a pool of 2 engine actors. One row's
    request kills its engine's process once (a test processor exits): Ray Data restarts the actor,
    the batch runs again, and every row comes out once, as the JSONL job wrote it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cluster.entrypoints.data import build_processor

    rows = data_rows()
    columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row)}
    pq.write_table(pa.table(columns), tmp_path / "in.parquet")
    source = tmp_path / "in.jsonl"  # the job's own input, plus the row that crashes its engine once
    crash = {"id": "crash", "prompt": "this one kills its engine once",
             "extra_args": {"exit_once": str(tmp_path / "crashed")}}
    source.write_text(job_input.read_text() + json.dumps(crash) + "\n")
    config = {**CONFIG, "processors": CONFIG["processors"] + ["failing_processors:ExitsOnce"],
              "cluster": {**CONFIG["cluster"], "num_engines": 2}}
    processor = build_processor(config, preprocess=lambda row: {**row, "seen": True},
                                postprocess=lambda row: {**row, "chars": len(row["generated_text"] or "")},
                                batch_size=8)
    parquet = ray.data.read_parquet(str(tmp_path / "in.parquet"), include_paths=True)
    jsonl = ray.data.read_json(str(source), include_paths=True)
    out = processor(parquet.union(jsonl)).materialize()
    out.write_parquet(str(tmp_path / "out-parquet"))
    out.write_json(str(tmp_path / "out-json"))
    assert (tmp_path / "crashed").exists()  # the engine did die
    written = pq.read_table(tmp_path / "out-parquet").to_pylist()
    as_json = [json.loads(line) for f in sorted((tmp_path / "out-json").iterdir()) for line in f.read_text().splitlines()]
    assert sorted(r["id"] for r in as_json) == sorted(r["id"] for r in written)
    from_parquet = [r for r in written if r["path"].endswith(".parquet")]
    from_json = {r["id"]: r for r in written if r["path"].endswith(".jsonl")}
    assert len(from_parquet) == len(rows) and len(from_json) == len(reference) + 1
    check_against_job(from_parquet, reference)
    assert all(r["seen"] and r["chars"] == len(r["generated_text"] or "") for r in written)
    assert from_json["crash"]["error"] is None and from_json["crash"]["num_generated_tokens"] == 16
    assert from_json["r5"]["error"].startswith("n=2")
    for rid, record in reference.items():
        if rid not in ("r5", "bad"):
            assert from_json[rid]["generated_token_ids"] == record["token_ids"] or record["error"], rid
            assert from_json[rid]["error"] == record["error"], rid


def test_the_example_parquet_holds_the_example_jsonl():
    """examples/prompts.parquet is examples/prompts.jsonl as dataset rows (the n=2 line aside, JSON schemas
    as strings: Arrow wants one type per column)."""
    from pathlib import Path

    import pyarrow.parquet as pq

    from cluster.entrypoints.data import _unset_nulls

    examples = Path(__file__).resolve().parents[3] / "examples"
    expected = []
    for line in map(json.loads, (examples / "prompts.jsonl").read_text().splitlines()):
        if line["sampling_params"].get("n", 1) == 1:
            schema = line["sampling_params"].get("structured_outputs", {})
            if "json" in schema:
                schema["json"] = json.dumps(schema["json"])
            expected.append(line)
    rows = [_unset_nulls(row) for row in pq.read_table(examples / "prompts.parquet").to_pylist()]
    assert rows == expected


def test_edge_lines_through_two_engines(group, tmp_path):
    """A few of tests/cluster/entrypoints/test_edges.py's lines on Ray: a BOM, the duplicate rule, a run-batch list of prompts."""
    from cluster.entrypoints.job_formats import OpenAIBatchFormat

    config = load_config(CONFIG)
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"id": "e", "prompt": "Hi", "sampling_params": {"max_tokens": 0}}
    source.write_bytes(b"\xef\xbb\xbf" + json.dumps(line).encode() + b"\n"
                       + json.dumps({**line, "sampling_params": {"max_tokens": 3}}).encode() + b"\n")
    run_job(config, group, source, output, max_in_flight=4)
    assert [r["error"] for r in map(json.loads, output.read_text().splitlines())] == [
        "invalid sampling_params: max_tokens must be at least 1, got 0.", "duplicate id 'e': an earlier line has it"]
    body = {"prompt": ["A", "B", "C"], "n": 2, "max_tokens": 3, "seed": 5}
    source.write_text(json.dumps({"custom_id": "three", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    output.unlink()
    run_job(config, group, source, output, max_in_flight=4, line_format=OpenAIBatchFormat(config))
    [record] = map(json.loads, output.read_text().splitlines())
    assert [c["index"] for c in record["response"]["body"]["choices"]] == list(range(6)), record


def test_row_functions_keep_the_column_types_a_small_batch_cannot_infer():
    """A preprocess/postprocess result is typed from its batch's rows: a field null in all of them
    comes out null-typed, and Parquet files of such blocks cannot be read back as one table. Those
    columns get their earlier type back; a column the function retyped keeps its new type."""
    import pyarrow as pa

    from cluster.entrypoints.data import typed_like

    before = pa.Table.from_pylist([{"sp": {"seed": 1, "stop": ["x"]}, "extra": {"t": "a"}, "n": 1},
                                   {"sp": {"seed": None, "stop": None}, "extra": None, "n": 2}])
    small = pa.Table.from_pylist([{"sp": {"seed": None, "stop": None}, "extra": None, "n": "one"}])
    typed = typed_like(small, before.schema)
    assert typed.schema.field("sp").type == before.schema.field("sp").type
    assert typed.schema.field("extra").type == before.schema.field("extra").type
    assert typed.schema.field("n").type == pa.string()  # retyped by the function: kept
    assert typed.to_pylist() == small.to_pylist()
    assert pa.concat_tables([before.drop_columns(["n"]), typed.drop_columns(["n"])]).num_rows == 3


def test_rows_sharing_an_id_give_what_they_give_in_batches_of_their_own():
    """A Ray Data batch is cut anywhere, and a dataset may hold an id twice (a union of two sources):
    no row's output may depend on which rows share its batch. Rows of one id run in rounds."""
    import pyarrow as pa

    from cluster.entrypoints.data import EngineStage

    stage = EngineStage({"model": {"tiny": "default", "max_model_len": 64}, "cluster": {"num_workers": 1},
                         "scheduler": {"max_num_seqs": 4}})
    params = {"max_tokens": 6, "temperature": 1.0}
    rows = [{"id": "a", "prompt": "first one", "sampling_params": params},
            {"id": "a", "prompt": "second one", "sampling_params": params},
            {"id": "b", "prompt": "first one", "sampling_params": params},
            {"id": "a", "prompt": "first one", "sampling_params": params}]
    together = stage(pa.Table.from_pylist(rows)).to_pylist()
    alone = [stage(pa.Table.from_pylist([row])).to_pylist()[0] for row in rows]
    assert [r["error"] for r in together] == [None] * 4
    assert [r["generated_token_ids"] for r in together] == [r["generated_token_ids"] for r in alone]
    assert together[0]["generated_token_ids"] == together[3]["generated_token_ids"]  # unseeded: keyed by its id
    stage.engine.shutdown()

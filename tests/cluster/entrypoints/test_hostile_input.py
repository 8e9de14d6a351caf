"""What a careless or hostile user can do to a job, each in a process of its own as it would run.

A 50 MB line costs neither memory nor time; Ctrl-C while the engine starts exits cleanly with the
resume hint; a private Ray instance listens on loopback only. The one-line refusals (templates in
input lines, a max_model_len past the model's limit, engine failures' exit code) are in
``tests/cluster/entrypoints/test_edges.py``.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from helpers import ctrl_c_reaches_it, pythonpath, run_job_main, tiny_job_config

ROOT = Path(__file__).resolve().parents[3]


# The ``raysample`` command, which prints its peak resident memory on stderr as it exits (an exit handler:
# the command leaves through ``exit_now``, as installed; a plain interpreter exit can abort in a native
# thread's teardown, "terminate called without an active exception", which the command never meets).
MEASURED_MAIN = ("import atexit, resource, sys; atexit.register(lambda: print('MAXRSS_KIB', "
                 "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); "
                 "from cluster.entrypoints.job import cli; cli()")


def job(tmp_path: Path, lines: list[bytes], *extra: str) -> tuple[list[str], Path]:
    """The CLI on a tiny model in this process (``--local``); it prints its peak RSS on stderr when it exits."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_job_config()))
    (tmp_path / "in.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    output = tmp_path / "out.jsonl"
    output.unlink(missing_ok=True)
    args = [sys.executable, "-c", MEASURED_MAIN, "generate", "--config", str(tmp_path / "c.yaml"), "--input",
            str(tmp_path / "in.jsonl"), "--output", str(output), "--local", *extra]
    return args, output


def peak_mib(stderr: str) -> float:
    return int(next(line.split()[1] for line in stderr.splitlines() if line.startswith("MAXRSS_KIB"))) / 1024


def test_a_50_mb_line_costs_no_memory_and_no_time(tmp_path):
    big = json.dumps({"id": "big", "prompt": "x" * (50 << 20)}).encode()
    good = json.dumps({"id": "good", "prompt": "Hello", "sampling_params": {"max_tokens": 4}}).encode()
    args, _ = job(tmp_path, [good])
    clean = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    args, output = job(tmp_path, [big, good])
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    # Refused on its size, before it is parsed or tokenized (tokenizing it first took 75 s and 9 GiB).
    assert records[None]["error"].startswith(f"line is {len(big) + 1} bytes: more than any request")
    assert records["good"]["error"] is None
    grew = peak_mib(done.stderr) - peak_mib(clean.stderr)
    assert grew < 32, grew  # read through in 1 MiB pieces, never held (holding it alone is 50 MiB)


def test_an_error_raised_over_an_interrupt_is_the_interrupt(tmp_path, capsys, monkeypatch):
    """Ctrl-C inside ``Thread.start`` (the job starts its tokenizer thread while the engine starts) made
    CPython raise ``RuntimeError: release unlocked lock`` over the KeyboardInterrupt: a traceback and
    exit 1 instead of the resume hint and 130 (seen once in CI). An error with no interrupt behind it
    still propagates."""
    from cluster.entrypoints import job as job_module

    def interrupted_in_threading(args):
        try:
            raise job_module.Terminated() if str(args.output).endswith("term.jsonl") else KeyboardInterrupt()
        except KeyboardInterrupt:
            raise RuntimeError("release unlocked lock")  # as threading raises it, over the interrupt

    monkeypatch.setattr(job_module, "_run", interrupted_in_threading)
    base = ["generate", "--config", "c.yaml", "--input", "in.jsonl", "--output"]
    assert job_module.main([*base, str(tmp_path / "int.jsonl")]) == 130
    assert job_module.main([*base, str(tmp_path / "term.jsonl")]) == 143
    err = capsys.readouterr().err
    assert err.count("Re-running the same command resumes") == 2 and "Traceback" not in err, err

    def plain_error(args):
        raise RuntimeError("a real failure")

    monkeypatch.setattr(job_module, "_run", plain_error)
    with pytest.raises(RuntimeError, match="a real failure"):
        job_module.main([*base, str(tmp_path / "out.jsonl")])


def test_ctrl_c_while_the_engine_starts_exits_130_with_the_resume_hint(tmp_path):
    args, _ = job(tmp_path, [json.dumps({"id": 1, "prompt": "Hi"}).encode()])
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_reaches_it)
    first = proc.stdout.readline()  # "[raysample] starting ...": the engine is starting now
    assert first.startswith("[raysample] starting"), first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Re-running the same command resumes" in err and "Traceback" not in err, err[-2000:]


@pytest.mark.ray
def test_a_private_ray_instance_listens_on_loopback_only():
    script = textwrap.dedent("""
        import psutil, ray
        from cluster.config import load_config
        from cluster.ray.ray_cluster import ensure_ray
        ensure_ray(load_config({"model": {"tiny": "default"}}))
        ray.get(ray.remote(lambda: 1).remote())  # a worker process too
        listening = set()
        for process in psutil.Process().children(recursive=True):
            try:
                for conn in process.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        listening.add(conn.laddr.ip)
            except psutil.Error:
                pass
        print("LISTEN", sorted(listening))
        print("METRICS", ray.nodes()[0]["NodeManagerAddress"])
        ray.shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("LISTEN", "METRICS")))
    addresses = ast.literal_eval(lines["LISTEN"])
    assert addresses and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in addresses), addresses
    assert lines["METRICS"] == "127.0.0.1"


# ----- round 2: lines that are deep, fan out, or reach the tokenizer; exits; torn records -----

NESTED = "__nested__"


def with_nested(line: str, depth: int) -> str:
    """``line`` with its ``"__nested__"`` string replaced by arrays nested ``depth`` deep (as text: json.dumps
    itself cannot write 2,000 levels)."""
    return line.replace(json.dumps(NESTED), "[" * depth + "]" * depth)


def chat(rid: str, **extra) -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": f"Say {rid}"}], "sampling_params": {"max_tokens": 6},
            **extra}


GOOD_LINES = [
    {"id": "g1", "prompt": "Hello there", "sampling_params": {"temperature": 0.0, "max_tokens": 8}},
    {"id": "g2", "prompt": "The quick brown fox", "sampling_params": {"seed": 3, "max_tokens": 8}},
    chat("g3", chat_template_kwargs={"enable_thinking": False}),
    {"id": "g4", "prompt": "schema", "sampling_params": {"max_tokens": 8, "structured_outputs": {
        "json": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}}}},
]
DEPTH_ERROR = "the line nests objects/arrays more than 64 levels deep (input.max_json_depth=64); it was not used"
HOSTILE_LINES = {  # line -> (the id its record has, its error)
    # 4 KB nesting 2,000 levels: json.loads raised RecursionError and the job died
    with_nested(json.dumps({"id": "deep", "prompt": "Hi", "extra_args": {"x": NESTED}}), 2000): (None, DEPTH_ERROR),
    with_nested(json.dumps({"id": "deep70", "prompt": "Hi", "extra_args": {"x": NESTED}}), 70): (None, DEPTH_ERROR),
    json.dumps(chat("pad", chat_template_kwargs={"padding": "max_length", "max_length": 200_000_000})):
        ("pad", "chat_template_kwargs.max_length is not allowed: it is an option of the tokenizer's call, not a "
                "variable of the chat template (chat_template_kwargs reach the template only)"),
    json.dumps(chat("trunc", chat_template_kwargs={"truncation": True})):
        ("trunc", "chat_template_kwargs.truncation is not allowed: it is an option of the tokenizer's call, not a "
                  "variable of the chat template (chat_template_kwargs reach the template only)"),
}


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def by_id(path: Path) -> dict:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def same_result(a: dict, b: dict) -> bool:
    return (a["token_ids"], a["text"], a["error"]) == (b["token_ids"], b["text"], b["error"])


def test_deep_lines_and_tokenizer_options_fail_alone_and_cost_no_memory(tmp_path):
    """Each hostile line gets its own error; every other line equals a clean run; peak memory stays near it."""
    args, output = job(tmp_path, [json.dumps(r).encode() for r in GOOD_LINES])
    clean = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    clean_records = by_id(output)
    hostile = [line.encode() for line in HOSTILE_LINES] + [json.dumps(r).encode() for r in GOOD_LINES]
    args, output = job(tmp_path, hostile)
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    errors = sorted((r["id"] or "", r["error"]) for r in records if r.get("finish_reason") == "error")
    assert errors == sorted((rid or "", error) for rid, error in HOSTILE_LINES.values())
    results = {r["id"]: r for r in records if r.get("finish_reason") != "error"}
    assert set(results) == {r["id"] for r in GOOD_LINES}
    assert all(same_result(results[k], clean_records[k]) for k in results), (results, clean_records)
    assert peak_mib(done.stderr) <= 1.5 * peak_mib(clean.stderr), (peak_mib(done.stderr), peak_mib(clean.stderr))


def batch_line(custom_id: str, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"max_tokens": 6, **body}})


def test_run_batch_lines_that_fan_out_or_nest_fail_alone(tmp_path):
    """200,000 prompts in one line became 200,000 requests and nothing was written for minutes."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_job_config()))
    good = [batch_line("ok1", prompt="Hello there", temperature=0),
            batch_line("ok2", prompt=["one", "two"], temperature=0.7, seed=1, n=2),
            batch_line("ok3", url="/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], temperature=0)]
    hostile = {
        batch_line("fan", prompt=["a"] * 200_000): "this line asks for 200000 sequences (200000 prompts x n=1); a line "
            "may ask for at most 1024 (input.max_requests_per_line in the config); split it into several lines",
        batch_line("fan-n", prompt=["a", "b"], n=600, temperature=1): "this line asks for 1200 sequences (2 prompts x "
            "n=600); a line may ask for at most 1024 (input.max_requests_per_line in the config); split it into "
            "several lines",
        with_nested(batch_line("deep", prompt="x", vllm_xargs={"x": NESTED}), 500): DEPTH_ERROR,
        batch_line("pad", url="/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                   chat_template_kwargs={"padding": "max_length"}): "chat_template_kwargs.padding is not allowed: it is "
            "an option of the tokenizer's call, not a variable of the chat template (chat_template_kwargs reach the "
            "template only)",
    }
    outputs, peaks = {}, {}
    for name, lines in (("clean", good), ("hostile", [*hostile, *good])):
        write_lines(tmp_path / f"{name}.jsonl", lines)
        out = tmp_path / f"{name}.out.jsonl"
        done = subprocess.run([sys.executable, "-c", MEASURED_MAIN, "run-batch", "-i", str(tmp_path / f"{name}.jsonl"),
                               "-o", str(out), "--config", str(tmp_path / "c.yaml"), "--local"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        outputs[name] = {r["custom_id"] or r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        peaks[name] = peak_mib(done.stderr)
    assert peaks["hostile"] <= 1.5 * peaks["clean"], peaks
    got = outputs["hostile"]
    for line, error in hostile.items():
        custom_id = json.loads(line)["custom_id"]
        record = got[custom_id] if custom_id in got else next(r for r in got.values() if r["error"] == error)
        assert (record["error"], record["response"]["status_code"]) == (error, 400)
    assert all(got[k]["error"] is None for k in ("ok1", "ok2", "ok3")), got
    for key in ("ok1", "ok2", "ok3"):
        assert got[key]["response"]["body"]["choices"] == outputs["clean"][key]["response"]["body"]["choices"]


def cli_job(tmp_path: Path, config: dict, lines: list[str], *extra: str) -> tuple[list[str], Path]:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    write_lines(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    return [sys.executable, "-m", "cluster.entrypoints.job", "generate", "--config", str(tmp_path / "c.yaml"), "--input",
            str(tmp_path / "in.jsonl"), "--output", str(output), *extra], output


def test_local_job_with_a_hung_processor_exits_by_itself(tmp_path):
    """The summary was printed, then the process stayed alive (an abandoned step thread held the exit)."""
    config = tiny_job_config()
    config["processors"] = [*config.get("processors", []), "failing_processors:HangsAtThirdToken"]
    config["cluster"]["call_timeout_s"] = 3
    args, output = cli_job(tmp_path, config, [
        json.dumps({"id": "hang", "prompt": "Hi", "extra_args": {"hang": True}, "sampling_params": {"max_tokens": 6}}),
        json.dumps({"id": "ok", "prompt": "Hello", "sampling_params": {"max_tokens": 6}})], "--local")
    env = {**os.environ, "RAYSAMPLE_TEST_HANG_S": "3600", "PYTHONPATH": pythonpath(ROOT / "tests" / "support")}
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert "[raysample] summary:" in done.stdout, done.stderr[-2000:]
    records = by_id(output)
    assert records["ok"]["error"] is None and "hung" in records["hang"]["error"], records


def wait_for_records(output: Path, count: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while (not output.exists() or len(output.read_text().splitlines()) < count) and time.monotonic() < deadline:
        time.sleep(0.1)


def long_lines(total: int = 100) -> list[str]:
    return [json.dumps({"id": i, "prompt": f"request {i}", "sampling_params": {"seed": i, "max_tokens": 24}})
            for i in range(total)]


def test_ctrl_c_or_sigterm_while_torch_loads_is_one_line(tmp_path):
    config = tiny_job_config()
    args, _ = cli_job(tmp_path, config, long_lines(2), "--local")
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=ctrl_c_reaches_it)
        time.sleep(0.5)  # importing torch and the engine takes seconds
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == code, err[-2000:]
        assert "Traceback" not in err and err.count("raysample: interrupted") == 1, err[-2000:]


def test_a_torn_record_mid_file_is_set_aside_and_its_line_runs_again(tmp_path, capsys):
    """The job's main in this process (what is checked is what it writes, not how its process ends)."""
    config = tiny_job_config()
    lines = long_lines(6)
    args, output = cli_job(tmp_path, config, lines, "--local")
    argv = args[args.index("generate"):]
    first = run_job_main(capsys, *argv)
    assert first.returncode == 0, first.stderr[-2000:]
    clean = output.read_text().splitlines()
    torn = clean[2][: len(clean[2]) // 2]  # cut mid-record, the rest of the file after it
    output.write_text("\n".join([*clean[:2], torn, *clean[3:]]) + "\n")
    again = run_job_main(capsys, *argv)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("torn record") == 1 and "1 torn record(s)" in again.stderr, again.stderr[-2000:]
    assert (tmp_path / "out.jsonl.rejected").read_text() == torn + "\n"
    records = [json.loads(line) for line in output.read_text().splitlines()]  # valid JSONL throughout
    assert sorted(r["id"] for r in records) == list(range(6))
    assert {r["id"]: r["token_ids"] for r in records} == {r["id"]: r["token_ids"] for r in map(json.loads, clean)}


@pytest.mark.ray
def test_on_ray_sigterm_is_one_line_and_143_and_a_dead_coordinator_is_reported_once(tmp_path):
    """Ray's own SIGTERM handler aborted with a native dump (exit 134); a killed coordinator was reported
    twice (the second time as a traceback from shutting down)."""
    import psutil

    config = tiny_job_config()
    config["scheduler"]["max_num_seqs"] = 2
    config["cluster"]["num_workers"] = 1  # what is tested here is the driver's and the coordinator's: one worker does
    args, output = cli_job(tmp_path, config, [*HOSTILE_LINES, *(json.dumps(r) for r in GOOD_LINES), *long_lines(60)])
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_records(output, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert err.count("raysample: interrupted") == 1 and "SIGTERM received" not in err and "Traceback" not in err, err
    written = len(output.read_text().splitlines())

    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_records(output, written + 2)
    coordinators = [p for p in psutil.Process(proc.pid).children(recursive=True)
                    if "CoordinatorActor" in " ".join(p.cmdline() or [p.name()])]
    assert coordinators, "no coordinator process found"
    for p in coordinators:
        p.kill()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("raysample:")]
    assert len(ours) == 1 and ours[0].startswith("raysample: the job failed: EngineGone"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]

    # The resume reads the records the two Ray runs left; it needs no third Ray instance to show it.
    resumed = subprocess.run([*args, "--local"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    ids = [r["id"] for r in records if r.get("finish_reason") != "error" or r["id"] is not None]
    assert len(ids) == len(set(ids))  # each id once, across three runs
    errors = sorted((r["id"] or "", r["error"]) for r in records if r.get("finish_reason") == "error")
    assert errors == sorted((rid or "", error) for rid, error in HOSTILE_LINES.values())
    assert {r["id"] for r in records if r.get("finish_reason") != "error"} == \
        {r["id"] for r in GOOD_LINES} | set(range(60))


def test_the_depth_bound_counts_levels_exactly_and_never_recurses():
    from hypothesis import given
    from hypothesis import strategies as st

    from cluster.entrypoints.json_input import JSONLineError, json_depth_over, load_json

    def depth(value) -> int:
        if isinstance(value, dict):
            return 1 + max(map(depth, value.values()), default=0)
        if isinstance(value, list):
            return 1 + max(map(depth, value), default=0)
        return 0

    values = st.recursive(st.none() | st.integers() | st.text(max_size=3),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
                          max_leaves=30)

    @given(values, st.integers(1, 8))
    def agrees(value, limit):
        assert json_depth_over(value, limit) == (depth(value) > limit)

    agrees()
    deep = "[" * 100_000 + "]" * 100_000  # past the interpreter's recursion limit: refused, not a crash
    for text, limit in ((deep, 64), ("[" * 65 + "]" * 65, 64)):
        with pytest.raises(JSONLineError, match="more than 64 levels deep"):
            load_json(text, limit)
    assert load_json("[" * 64 + "]" * 64, 64)


def test_a_schema_given_as_text_too_deep_to_parse_is_that_lines_error():
    from cluster.entrypoints.job_lines import BadLine, InputLimits, parse_line

    deep = "[" * 5000 + "]" * 5000
    for params in ({"structured_outputs": {"json": deep}}, {"guided_json": deep}):
        with pytest.raises(BadLine, match="^invalid sampling_params: structured_outputs.json nests too deeply"):
            parse_line(json.dumps({"id": 1, "prompt": "x", "sampling_params": params}), {}, None, InputLimits(256, 10**6))

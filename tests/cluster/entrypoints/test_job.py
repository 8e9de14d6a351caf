"""The batch job end to end through its command line (the console script and ``python -m`` as processes,
``main`` in this process where only what the job writes is checked; tiny model, in-process engine)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ctrl_c_reaches_it, run_job_main, tiny_job_config

ROOT = Path(__file__).resolve().parents[3]

GOOD = [
    {"id": "a", "prompt": "Hello there", "sampling_params": {"temperature": 0.0, "max_tokens": 12}},
    {"id": 2, "prompt": "The quick brown fox", "sampling_params": {"seed": 5, "max_tokens": 10, "logprobs": 1}},
    {"id": "c", "prompt": "Repeat", "extra_args": {"target_token": 42}, "sampling_params": {"max_tokens": 5}},
    {"id": "d", "prompt_token_ids": [45, 74, 81], "vllm_xargs": {"target_token": 7}, "sampling_params": {"max_tokens": 4}},
    {"id": "e", "prompt": "stop here", "sampling_params": {"temperature": 0.0, "max_tokens": 30, "stop": ["a"]}},
]
GOOD.append({"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": True},
             "sampling_params": {"max_tokens": 4, "seed": 9}})
GOOD.append({"id": "so", "prompt": "Pick", "sampling_params": {"guided_choice": ["red", "green"], "max_tokens": 8, "seed": 4}})
GOOD.append({"id": "n3", "prompt": "three ways", "sampling_params": {"n": 3, "seed": 1, "max_tokens": 6, "logprobs": 0}})
for i in range(6, 20):
    GOOD.append({"id": f"r{i}", "prompt": f"request {i}", "sampling_params": {"seed": i, "max_tokens": 8 + i}})

BAD_LINES = [
    "this is not json",
    json.dumps({"prompt": "no id"}),
    json.dumps({"id": "bad-params", "prompt": "x", "sampling_params": {"temperature": -1}}),
    json.dumps({"id": "a", "prompt": "duplicate of a"}),
    json.dumps({"id": "both", "prompt": "x", "prompt_token_ids": [1]}),
    json.dumps({"id": "vocab", "prompt": "x", "sampling_params": {"logit_bias": {"999999": 1}}}),
]


@pytest.fixture()
def job_files(tmp_path):
    config = tiny_job_config()
    config["scheduler"]["max_num_seqs"] = 4
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    lines = [json.dumps(r) for r in GOOD[:3]] + BAD_LINES + [json.dumps(r) for r in GOOD[3:]]
    input_path = tmp_path / "prompts.jsonl"
    input_path.write_text("\n".join(lines) + "\n\n")
    return config_path, input_path, tmp_path / "out" / "results.jsonl"


def run_cli(*args: str, module: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cluster.entrypoints.job"] if module else [str(Path(sys.executable).parent / "raysample")]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_writes_results_and_error_records(job_files):
    config, source, output = job_files
    proc = run_cli("generate", "--config", str(config), "--input", str(source), "--output", str(output), "--local",
                   "--log-every", "0", "--show", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'vocab' (error): error: " in proc.stdout and "outside the vocabulary" in proc.stdout  # --show says why
    assert "'c' (length): " in proc.stdout
    out = records(output)
    by_id = {json.dumps(r["id"]): r for r in out if r.get("line") is None}
    assert set(by_id) == {json.dumps(r["id"]) for r in GOOD} | {json.dumps("bad-params"), json.dumps("vocab")} - {
        json.dumps("bad-params")}
    assert by_id['"c"']["token_ids"] == [42] * 5
    assert by_id['"d"']["token_ids"] == [7] * 4
    assert len(by_id["2"]["logprobs"]) == 10 and by_id["2"]["logprobs"][0]["rank"] >= 1
    assert by_id['"e"']["finish_reason"] in ("stop", "length") and "a" not in by_id['"e"']["text"]
    assert "outside the vocabulary" in by_id['"vocab"']["error"]
    assert by_id['"so"']["text"] in ("red", "green") and by_id['"so"']["finish_reason"] == "stop"
    assert by_id['"chat"']["prompt_tokens"] > 5 and len(by_id['"chat"']["token_ids"]) == 4
    n3 = by_id['"n3"']
    assert [c["index"] for c in n3["outputs"]] == [0, 1, 2] and n3["token_ids"] == n3["outputs"][0]["token_ids"]
    assert all(len(c["token_ids"]) == 6 and len(c["logprobs"]) == 6 for c in n3["outputs"])
    assert len({tuple(c["token_ids"]) for c in n3["outputs"]}) == 3
    assert "KV cache:" in proc.stdout
    errors = [r for r in out if r.get("line") is not None]
    messages = [r["error"] for r in errors]
    assert any("not valid JSON" in m for m in messages)
    assert any("missing 'id'" in m for m in messages)
    assert any("temperature must be in [0, 2], got -1" in m for m in messages)
    assert any("duplicate id 'a'" in m for m in messages)
    assert any("exactly one of 'prompt', 'prompt_token_ids' or 'messages'" in m for m in messages)
    assert all(r["timing"]["total_s"] >= 0 for r in by_id.values())
    assert "[raysample] summary:" in proc.stdout and "errors" in proc.stdout
    assert "requests, " in proc.stdout  # periodic progress lines when not on a terminal
    # The summary names the first errors with their line numbers, in the order they were written.
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if "error(s), each a record with \"error\" in" in line)
    assert lines[head].startswith(f"[raysample] the first 5 of {len(errors) + 1} error(s)"), lines[head]
    shown = lines[head + 1 : head + 6]
    written = [r for r in out if r.get("error") is not None][:5]
    for record, line in zip(written, shown, strict=True):
        assert re.match(r"\[raysample\]   line \d+", line), line
        if record.get("line") is not None:  # a line refused before it ran names its line number too
            assert line.startswith(f"[raysample]   line {record['line']}"), (record, line)
    assert all(r["error"][:40] in line for r, line in zip(written, shown)), (written, shown)


def test_resume_after_partial_output_gives_each_id_once_and_same_results(job_files, capsys):
    import ray

    config, source, output = job_files
    first = run_job_main(capsys, "generate", "--config", str(config), "--input", str(source), "--output", str(output),
                     "--local")
    assert first.returncode == 0, first.stderr[-3000:]
    complete = records(output)
    # Keep 7 records and a torn eighth, as if the job had been killed mid-write.
    lines = output.read_text().splitlines(keepends=True)
    output.write_text("".join(lines[:7]) + lines[7][: len(lines[7]) // 2])
    second = run_job_main(capsys, "generate", "--config", str(config), "--input", str(source), "--output", str(output),
                      "--local")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = records(output)
    results = [json.dumps(r["id"]) for r in resumed if "line" not in r]  # one per request, error lines aside
    assert len(results) == len(set(results)) == len([r for r in complete if "line" not in r])
    assert "7 skipped" in second.stdout  # every kept record, result or error line, is not redone
    same = {json.dumps(r["id"]): r["token_ids"] for r in complete if "token_ids" in r}
    again = {json.dumps(r["id"]): r["token_ids"] for r in resumed if "token_ids" in r}
    assert same == again  # seeded and greedy requests regenerate identically
    # Finished: a re-run (on Ray, without --local) reads the output and stops before starting anything.
    before = output.read_text()
    third = run_job_main(capsys, "generate", "--config", str(config), "--input", str(source), "--output", str(output))
    assert third.returncode == 0, third.stderr[-3000:]
    assert "nothing to do" in third.stdout and "starting" not in third.stdout and "Ray" not in third.stderr
    assert not ray.is_initialized()
    assert output.read_text() == before


def records_from_lines(lines: list[str]) -> list[dict]:
    return [json.loads(line) for line in lines]


def test_job_level_failures_exit_non_zero(tmp_path, job_files, capsys):
    config, source, output = job_files
    missing = run_cli("generate", "--config", str(tmp_path / "nope.yaml"), "--input", str(source), "--output", str(output))
    assert missing.returncode == 2 and "cannot read config" in missing.stderr  # the process's own exit status
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("model: {tiny: default}\nscheduler: {max_num_seqs: -3}\n")
    invalid = run_job_main(capsys, "generate", "--config", str(bad_config), "--input", str(source), "--output", str(output),
                       "--local")
    assert invalid.returncode == 2 and "scheduler.max_num_seqs" in invalid.stderr
    no_input = run_job_main(capsys, "generate", "--config", str(config), "--input", str(tmp_path / "none.jsonl"),
                        "--output", str(output))
    assert no_input.returncode == 2 and "does not exist" in no_input.stderr


def test_ctrl_c_then_sigterm_stop_cleanly_and_say_rerunning_resumes(tmp_path):
    """Mid-run, a step in a torch kernel: SIGTERM aborted with "terminate called without an active exception"
    (exit 134) when the interpreter tore that thread down; now the job exits without tearing threads down.
    Ctrl-C stops the first run (130), SIGTERM the rerun that resumed it (143), and a third run finishes."""
    import signal
    import time

    config = tiny_job_config()
    config["scheduler"]["max_num_seqs"] = 2
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    total = 100  # enough that each signal lands mid-run however fast the engine is (two rows at a time)
    # 25 documents asked 4 questions each, question by question: the job submits each document's questions
    # together (input.group_by_prefix), so a signal lands mid-group, and the resume completes the groups.
    docs = [[3 + (7 * d + k) % 500 for k in range(48)] for d in range(25)]
    lines = [json.dumps({"id": i, "prompt_token_ids": docs[i % 25] + [5, 6, 7, i],
                         "sampling_params": {"seed": i, "max_tokens": 12}}) for i in range(total)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    args = ["generate", "--config", str(tmp_path / "c.yaml"), "--input", str(tmp_path / "in.jsonl"),
            "--output", str(output), "--local", "--log-every", "0"]
    written = 0
    for signal_name, code in (("SIGINT", 130), ("SIGTERM", 143)):
        proc = subprocess.Popen([sys.executable, "-m", "cluster.entrypoints.job", *args], cwd=ROOT, preexec_fn=ctrl_c_reaches_it,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while (not output.exists() or len(output.read_text().splitlines()) < written + 3) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(getattr(signal, signal_name))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == code, (signal_name, err[-2000:])
        assert err.count("Re-running the same command resumes") == 1 and "Traceback" not in err and "terminate" not in err
        partial = records(output)  # every line whole
        assert written + 3 <= len(partial) < total, signal_name
        assert len({r["id"] for r in partial}) == len(partial)  # the rerun wrote no id twice
        written = len(partial)
    resumed = run_cli(*args, module=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(r["id"] for r in records(output)) == list(range(total))
    summary = next(line for line in resumed.stdout.splitlines() if line.startswith("[raysample] prompt tokens:"))
    computed, given = (int(n) for n in re.findall(r"(\d+) computed of (\d+) given", summary)[0])
    assert computed < 0.6 * given and "found in the prefix cache" in summary, summary  # each document about once

"""`ray job submit` as a user runs it, on a head started the way Ray 2.60 starts one.

`ray start --head` turns token authentication on when a token exists (``~/.ray/auth_token``, or
``RAY_AUTH_TOKEN_PATH``); the job client then needs ``RAY_AUTH_MODE=token``, as docs/guide.md says.
One head serves every test here.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers import tiny_job_config

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: each socket stays bound until all are picked (one at a time, the
    system handed the same port out twice and `ray start` refused it)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A token-auth head; yields (dashboard address, the environment of a user who followed docs/guide.md)."""
    home = tmp_path_factory.mktemp("ray_home")
    token = home / ".ray" / "auth_token"
    # As a user's shell: the venv activated, RAY_AUTH_MODE unset, a token from an earlier ray.init().
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    base["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    generate = subprocess.run([RAY, "get-auth-token", "--generate"], capture_output=True, text=True, timeout=60,
                              env=base | {"HOME": str(home)})
    assert generate.returncode == 0 and token.read_text().strip(), generate.stderr
    base["RAY_AUTH_TOKEN_PATH"] = str(token)  # this test's own token, wherever HOME is
    # Ports of its own: Ray's fixed defaults (the dashboard agent's 52365, the client server's 10001) are taken
    # by whichever cluster on this host started first, and a head without its agent takes no job.
    port, dashboard, agent, client = free_ports(4)
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's socket paths live under it
    start = subprocess.run(
        [RAY, "start", "--head", f"--port={port}", f"--dashboard-port={dashboard}", "--num-cpus=4",
         f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}", f"--temp-dir={temp_dir}",
         "--include-dashboard=true", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=180, env=base,
    )
    assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
    assert "Token authentication is enabled" in start.stdout + start.stderr
    try:
        yield f"http://127.0.0.1:{dashboard}", base
    finally:
        stop_head(temp_dir)


def stop_head(temp_dir: str) -> None:
    """This head's processes only (found by its temp dir), not `ray stop`, which ends every Ray cluster on
    the host, those of tests running beside this one included."""
    import psutil

    ours = []
    for process in psutil.process_iter(["cmdline"]):
        if any(temp_dir in arg for arg in process.info["cmdline"] or []):
            try:
                ours += [process, *process.children(recursive=True)]
            except psutil.Error:
                pass
    for process in ours:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(ours, timeout=3)  # some of Ray's take 15 s over SIGTERM: a test head needs no grace
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)


def submit(address: str, env: dict[str, str], entrypoint: list[str], *extra: str) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir . -- <entrypoint>` from the repository root, as docs/guide.md shows it."""
    return subprocess.run(
        [RAY, "job", "submit", f"--address={address}", "--working-dir", ".", *extra, "--", *entrypoint],
        capture_output=True, text=True, timeout=900, env=env | {"RAY_AUTH_MODE": "token"}, cwd=ROOT,
    )


def test_token_auth_is_on_and_the_client_needs_the_variable(ray_head):
    address, env = ray_head
    listing = subprocess.run([RAY, "job", "list", f"--address={address}"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert listing.returncode != 0 and "Authentication" in listing.stdout + listing.stderr
    listing = subprocess.run([RAY, "job", "list", f"--address={address}"], capture_output=True, text=True,
                             timeout=120, env=env | {"RAY_AUTH_MODE": "token"})
    assert listing.returncode == 0, listing.stderr[-2000:]


def test_ray_job_submit_as_the_guide_shows_it(ray_head, tmp_path):
    address, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"id": i, "prompt": f"job request {i}",
                    "sampling_params": {"seed": i, "max_tokens": 6, "ignore_eos": True}}) + "\n"
        for i in range(6)
    ) + json.dumps({"id": "target", "prompt": "x", "extra_args": {"target_token": 9},
                    "sampling_params": {"max_tokens": 3}}) + "\n" + json.dumps(
        {"id": "scored", "prompt_token_ids": SCORED, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 2}}) + "\n")
    output = tmp_path / "results.jsonl"
    run = submit(address, env, ["python", "-m", "cluster.entrypoints.job", "generate", "--config", "configs/default.yaml",
                                "--input", str(prompts), "--output", str(output)])
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, log
    assert "succeeded" in log.lower()
    full = run.stdout + run.stderr
    assert "Loading weights" not in full and "Tearing down compiled DAG" not in full  # quiet worker logs
    assert "[raysample] starting smollm2-135m-instruct on 2 worker(s)" in full and "the Ray job's cluster" in full
    # make run's config prints four lines of its own (start, KV cache, summary, prompt tokens), nothing else
    # but progress lines, every 10 s when not on a terminal (a loaded machine takes that long).
    progress = re.compile(r"^\[raysample\] \d+/\d+ requests, ")
    job_lines = [line for line in job_log_lines(run.stdout) if not progress.match(line)]
    assert [line.split(":")[0].split(" ")[1] for line in job_lines] == ["starting", "engine", "summary", "prompt"], \
        "\n".join(job_lines)
    records = {str(r["id"]): r for r in map(json.loads, output.read_text().splitlines())}
    assert set(records) == {*map(str, range(6)), "target", "scored"}
    assert all(len(records[str(i)]["token_ids"]) == 6 and records[str(i)]["error"] is None for i in range(6))
    assert records["target"]["token_ids"] == [9, 9, 9]
    # Prompt logprobs on Ray, the real model in float32: transformers' float32 log-softmax of the same prompt.
    from scoring import reference_logprobs

    from cluster.config import resolve

    reference = reference_logprobs(resolve({"model": {"preset": "smollm2-135m-instruct"}}).facts.path, SCORED)
    scored = records["scored"]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(SCORED)
    for i, entry in enumerate(scored[1:]):
        assert entry["token_id"] == SCORED[i + 1] and len(entry["top"]) == 2
        assert abs(entry["logprob"] - float(reference[i, SCORED[i + 1]])) <= 1e-3
        ranked = reference[i].sort(descending=True).values  # ranks agree but where float32 ties what float64 orders
        assert abs(float(ranked[entry["rank"] - 1]) - float(reference[i, SCORED[i + 1]])) <= 1e-3


SCORED = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 330, 7717, 282, 8649, 9478, 582, 3703, 1301, 43, 971, 3116, 8211, 624, 1038, 13842, 30]  # the real model's ids of "The quick brown fox ... its own cache."


USER_PROCESSOR = '''
import torch
from processors import LogitsProcessor


class OnlyToken(LogitsProcessor):
    """Every row keeps one token: a package that lives outside the repository."""

    def __init__(self, vllm_config, device, is_pin_memory, token_id=0):
        self.token_id = token_id

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        kept = logits[:, self.token_id].clone()
        logits[:] = float("-inf")
        logits[:, self.token_id] = kept
        return logits
'''


def test_a_processor_package_outside_the_repo_ships_with_py_modules(ray_head, tmp_path):
    address, env = ray_head
    package = tmp_path / "elsewhere" / "acme_processors"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(USER_PROCESSOR))
    config = tmp_path / "acme.yaml"
    config.write_text(textwrap.dedent("""
        model: {tiny: default, dtype: float32, max_model_len: 128}
        cluster: {address: local, num_workers: 1}
        cache: {kv_cache_memory: 4MiB}
        processors:
          - class: acme_processors:OnlyToken
            kwargs: {token_id: 11}
    """))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}", "sampling_params": {"max_tokens": 4}}) + "\n"
                               for i in range(3)))
    entry = ["python", "-m", "cluster.entrypoints.job", "generate", "--config", str(config), "--input", str(prompts)]

    # Not shipped: the driver says so in one line, before any worker starts.
    missing = submit(address, env, entry + ["--output", str(tmp_path / "unshipped.jsonl")])
    assert missing.returncode != 0
    assert "acme_processors" in missing.stdout and "py_modules" in missing.stdout
    assert "Traceback" not in missing.stdout

    output = tmp_path / "results.jsonl"
    shipped = submit(address, env, entry + ["--output", str(output)],
                     "--runtime-env-json", json.dumps({"py_modules": [str(package)]}))
    assert shipped.returncode == 0, shipped.stdout[-4000:] + shipped.stderr[-4000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 3 and all(r["token_ids"] == [11] * 4 for r in records)


def test_a_relative_output_under_a_job_is_refused_with_what_to_pass(ray_head):
    address, env = ray_head
    run = submit(address, env, ["python", "-m", "cluster.entrypoints.job", "generate", "--config", "configs/default.yaml",
                                "--input", "examples/prompts.jsonl", "--output", "results/lost.jsonl"])
    assert run.returncode != 0
    assert "--output results/lost.jsonl is relative" in run.stdout and "absolute path" in run.stdout
    assert not (ROOT / "results" / "lost.jsonl").exists()


def test_address_local_starts_a_private_instance_while_another_cluster_runs(ray_head, tmp_path):
    """`ray start --head` is running on this host: `address: local` must not join it."""
    _, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": 1, "prompt": "private",
                                   "sampling_params": {"seed": 1, "max_tokens": 4, "ignore_eos": True}}) + "\n")
    output = tmp_path / "out.jsonl"
    config = tmp_path / "tiny.yaml"  # the model and the workers do not matter here: the tiny one, once
    job_config = tiny_job_config()
    job_config["cluster"]["num_workers"] = 1
    config.write_text(yaml.safe_dump(job_config))
    run = subprocess.run(
        [sys.executable, "-m", "cluster.entrypoints.job", "generate", "--config", str(config), "--input", str(prompts),
         "--output", str(output)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "a private Ray instance" in run.stdout
    assert len(json.loads(output.read_text())["token_ids"]) == 4


def test_the_ray_data_example_runs_as_the_guide_shows_it(ray_head, tmp_path):
    """Parquet in, Parquet out, on the default model's 2 workers inside one Ray Data engine actor."""
    import pyarrow.parquet as pq

    address, env = ray_head
    output = tmp_path / "parquet"
    run = submit(address, env, ["python", "examples/ray_data_parquet.py", "--input", "examples/prompts.parquet",
                                "--output", str(output)])
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0 and "succeeded" in log.lower(), log
    assert "[raysample] 7 rows written to" in run.stdout and ", 0 with an error" in run.stdout
    rows = {r["id"]: r for r in pq.read_table(output).to_pylist()}
    assert set(rows) == {"capital", "haiku", "plain", "json", "choice", "stop", "banana"}
    assert "Paris" in rows["capital"]["generated_text"]
    assert rows["banana"]["generated_text"] == " banana" * 6
    assert set(json.loads(rows["json"]["generated_text"])) == {"name", "age"}
    assert rows["choice"]["generated_text"] in ("yes", "no")
    assert rows["stop"]["finish_reason"] == "stop" and ", 5" not in rows["stop"]["generated_text"]


def test_tensor_parallel_config_through_ray_job_submit_equals_one_rank(ray_head, tmp_path):
    """configs/tensor-parallel.yaml: the real model in one group of 3 ranks (gloo), on the head's 4 CPUs;
    its greedy records on 8 chat prompts equal the in-process engine's on one rank (tokens exact; the
    job writes no logprobs here, tests/workers/model/test_tensor_parallel.py holds those to 1e-4 on the tiny model).
    Two lines name LoRA adapters (--lora-modules): each rank holds its slices of them."""
    from cluster.config import load_config
    from cluster.entrypoints.llm import LLM
    from processors import SamplingParams

    address, env = ray_head
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Is water wet? Answer in one word.",
                 "List three primary colors.", "What is 12 times 12?", "Name a famous painter.",
                 "Translate 'good morning' to French.", "Give me a synonym for happy."]
    from adapters import build_adapter, peft_greedy

    from cluster.config import resolve

    base = resolve({"model": {"preset": "smollm2-135m-instruct"}}).facts.path
    adapters = {kind: build_adapter(base, tmp_path / kind, kind, seed) for seed, kind in enumerate(["mlp-r8", "all-r16"])}
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": q}],
                                           "sampling_params": {"max_tokens": 24}}) + "\n"
                               for i, q in enumerate(questions)) + "".join(
        json.dumps({"id": kind, "model": kind, "prompt_token_ids": SCORED[:12], "sampling_params": {"max_tokens": 8}})
        + "\n" for kind in adapters))
    output = tmp_path / "tp.jsonl"
    run = submit(address, env, ["python", "-m", "cluster.entrypoints.job", "generate", "--config", "configs/tensor-parallel.yaml",
                                "--input", str(prompts), "--output", str(output),
                                "--lora-modules", *(f"{kind}={path}" for kind, path in adapters.items())])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    records = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    for kind, path in adapters.items():  # LoRA adapters split over the 3 ranks: transformers + peft's greedy tokens
        assert records[kind]["error"] is None and records[kind]["token_ids"] == peft_greedy(base, path, SCORED[:12], 8)
    config = load_config(ROOT / "configs" / "tensor-parallel.yaml")
    config = config.model_copy(update={"model": config.model.model_copy(update={"tensor_parallel_size": 1})})
    one_rank = LLM(config=config, local=True)
    wanted = one_rank.chat([[{"role": "user", "content": q}] for q in questions],
                           SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for i, (question, want) in enumerate(zip(questions, wanted)):
        assert records[i]["error"] is None and records[i]["token_ids"] == want.outputs[0].token_ids, question
    assert "Paris" in records[0]["text"]
    assert "on 1 worker(s) x 3 tensor-parallel ranks of 1 CPU each" in run.stdout
    # The job's own lines only: no Ray start-up notices, no lines from the engine's actors, nothing at exit.
    job_lines = job_log_lines(run.stdout)
    assert job_lines and all(line.startswith("[raysample] ") for line in job_lines), "\n".join(job_lines)


def job_log_lines(stdout: str) -> list[str]:
    """What the job printed: ``ray job submit``'s own lines taken out (its CLI's log records around the
    tailed logs, and the job supervisor's two lines before the entrypoint starts)."""
    framing = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\t[A-Z]+ (cli|job_manager)\.py:\d+ -- "
                         r"|Running entrypoint for job )")
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in stdout.splitlines()]
    return [line for line in plain if line.strip() and not framing.match(line)]

"""Nothing on disk makes the engine wrong or destructive: the input is never the output, every cached
artefact is verified before use (and rebuilt when it does not verify), and a fault every request
shares stops the job as the engine's, never as final per-request errors (docs/reliability.md).

Each test runs the job's ``main`` in this process on a temporary copy of the host's cache, as the
audit that found these did: ``tiny.yaml`` (the tiny model in float32, one local worker) and eight
seeded prompt lines."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from helpers import run_job_main

from cluster.entrypoints.job import main
from workers.cpu import exact_ops, native_attention
from workers.host_cache import cache_root
from workers.model.tiny import PRESETS, ensure_tiny_model

LINES = [{"id": f"l{i}", "prompt": f"line {i} says", "sampling_params": {"seed": i, "temperature": 0.8,
                                                                         "max_tokens": 8}} for i in range(8)]


def tokens_by_id(path: Path) -> dict:
    return {r["id"]: (r["token_ids"], r.get("error")) for r in map(json.loads, path.read_text().splitlines())}


def write_config(folder: Path, **cache: object) -> Path:
    config = folder / "tiny.yaml"
    config.write_text(yaml.safe_dump({"model": {"tiny": "default", "dtype": "float32", "max_model_len": 256},
                                      "cluster": {"num_workers": 1},
                                      "cache": {"kv_cache_memory": "16MiB", **cache}}))
    return config


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The eight lines' records from a clean run on the host's own cache."""
    folder = tmp_path_factory.mktemp("reference")
    source = folder / "base.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    ensure_tiny_model("default")
    assert main(["generate", "--local", "--config", str(write_config(folder)), "--input", str(source),
                 "--output", str(folder / "out.jsonl")]) == 0
    return tokens_by_id(folder / "out.jsonl")


def _fresh_kernels() -> None:
    native_attention._library.cache_clear()
    exact_ops._library.cache_clear()


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A copy of the host's cache (tiny models, kernel builds, probe verdicts) as this test's cache, the
    job's files, and a way to run the job on them."""
    host = cache_root()
    ensure_tiny_model("default")
    native_attention.build()
    exact_ops.native_build.build(exact_ops.SOURCE, exact_ops.FLAGS)
    copy = tmp_path / "cache"
    skip = shutil.ignore_patterns("*.lock", ".building-*", ".damaged-*", "*.tmp")
    for name in ("tiny", "row-tiles", "probes"):
        if (host / name).is_dir():
            shutil.copytree(host / name, copy / name, ignore=skip)
    shutil.copytree(native_attention.library_path().parent, copy / "kernels", ignore=skip)
    monkeypatch.setenv("RAYSAMPLE_CACHE_DIR", str(copy))
    monkeypatch.setenv("RAYSAMPLE_KERNEL_DIR", str(copy / "kernels"))
    _fresh_kernels()
    source = tmp_path / "base.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in LINES))

    class Job:
        cache = copy
        input = source
        output = tmp_path / "out.jsonl"
        config = write_config(tmp_path)
        folder = tmp_path

        @staticmethod
        def run(capsys, *extra: str, command: str = "generate", config: Path | None = None,
                output: Path | None = None) -> subprocess.CompletedProcess:
            flags = ("--input", "--output") if command == "generate" else ("-i", "-o")
            return run_job_main(capsys, command, "--local", "--config", str(config or Job.config), flags[0],
                                str(Job.input), flags[1], str(output or Job.output), *extra)

    yield Job
    _fresh_kernels()  # the next test loads the host's own builds again


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ----- 1: the input is never the output -----


def test_the_output_cannot_be_the_input_or_the_config_however_it_is_spelled(job, capsys, monkeypatch):
    before = job.input.read_bytes(), job.config.read_bytes()
    link = job.folder / "link.jsonl"
    link.symlink_to(job.input)
    hard = job.folder / "hard.jsonl"
    os.link(job.input, hard)
    monkeypatch.chdir(job.folder)
    for output, extra in ((job.input, ()), (job.input, ("--overwrite",)), (Path("./base.jsonl"), ("--overwrite",)),
                          (link, ("--overwrite",)), (hard, ()), (job.config, ())):
        done = job.run(capsys, *extra, output=output)
        assert done.returncode == 2, (output, done)
        assert "are the same file" in one_line(done.stderr) and not done.stdout
    done = job.run(capsys, "--overwrite", command="run-batch", output=Path("./base.jsonl"))
    assert done.returncode == 2 and "are the same file" in one_line(done.stderr)
    rejected = job.folder / "out.jsonl.rejected"  # torn records go there: it is the output's, never the input
    rejected.symlink_to(job.input)
    done = job.run(capsys)
    assert done.returncode == 2 and "are the same file" in one_line(done.stderr)
    assert (job.input.read_bytes(), job.config.read_bytes()) == before
    assert not list(job.folder.glob("*.rejected*"))[0].resolve() != job.input.resolve()
    assert not job.output.exists() and not list(job.folder.glob(".*.tmp"))


def test_a_symlinked_output_with_a_torn_record_is_rewritten_where_it_points(job, capsys, reference):
    target = job.folder / "real" / "results.jsonl"
    target.parent.mkdir()
    assert job.run(capsys, output=target).returncode == 0
    lines = target.read_text().splitlines()
    target.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20] + "\n" + "\n".join(lines[6:]) + "\n")  # torn
    link = job.folder / "out.jsonl"
    link.symlink_to(target)
    done = job.run(capsys, output=link)
    assert done.returncode == 0 and "1 torn record(s)" in done.stderr
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert tokens_by_id(target) == reference
    assert (job.folder / "out.jsonl.rejected").read_text() == lines[5][:20] + "\n"


def test_a_rejected_file_that_cannot_be_written_is_one_line_and_exit_2_with_nothing_left_behind(job, capsys):
    assert job.run(capsys).returncode == 0
    lines = job.output.read_text().splitlines()
    torn = "\n".join(lines[:3] + [lines[3][:25]] + lines[4:]) + "\n"  # its line must run again
    job.output.write_text(torn)
    rejected = job.folder / "out.jsonl.rejected"
    rejected.mkdir()  # cannot be opened for appending, even by root
    done = job.run(capsys)
    assert done.returncode == 2 and "cannot be written" in one_line(done.stderr) and "starting" not in done.stdout
    assert job.output.read_text() == torn and not list(job.folder.glob(".*.tmp"))
    rejected.rmdir()
    rejected.write_text("")
    if subprocess.run(["chattr", "+i", str(rejected)], capture_output=True).returncode == 0:  # where allowed
        try:
            done = job.run(capsys)
            assert done.returncode == 2 and "cannot be written" in one_line(done.stderr)
            assert job.output.read_text() == torn and not list(job.folder.glob(".*.tmp"))
        finally:
            subprocess.run(["chattr", "-i", str(rejected)], check=True)


# ----- 4 and 8: the output's bookkeeping never trusts a record's types -----


@pytest.mark.parametrize("command", ["generate", "run-batch"])
def test_hand_edited_records_of_any_json_type_mark_nothing_done_and_raise_nothing(job, capsys, command, reference):
    if command == "run-batch":
        job.input.write_text("".join(json.dumps({"custom_id": line["id"], "method": "POST", "url": "/v1/completions",
                                                 "body": {"prompt": line["prompt"], **line["sampling_params"]}}) + "\n"
                                     for line in LINES))
    id_field = "id" if command == "generate" else "custom_id"
    odd = [["x"], {"a": 1}, None, True, 1.5, "", 0, [], {}]
    records = [{id_field: value, "error": "x", "input_sha": value, "retryable": value} for value in odd]
    records += [{id_field: value} for value in odd]
    records += [{id_field: "l0", "error": {"nested": [1]}, "input_sha": ["x"]},
                {id_field: "l1", "retryable": "yes", "error": None},
                {id_field: ["l2"], "token_ids": "nope"}, {"input_sha": {"x": 1}, "error": 3}]
    job.output.write_text("".join(json.dumps(r) + "\n" for r in records))
    done = job.run(capsys, command=command)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "for 8 request(s)" in done.stdout  # every line ran: none was done
    if command == "generate":
        ran = {r["id"]: (r["token_ids"], r.get("error")) for r in map(json.loads, job.output.read_text().splitlines())
               if isinstance(r.get("id"), str) and "prompt_tokens" in r}
        assert ran == reference


# ----- 9: the summary counts every sequence -----


def test_the_summary_counts_every_sequence_of_n_and_says_preempted_only_after_a_preemption(job, capsys):
    job.input.write_text("".join(json.dumps({**line, "sampling_params": {**line["sampling_params"], "n": 2,
                                                                          "max_tokens": 4, "ignore_eos": True}}) + "\n"
                                 for line in LINES))
    done = job.run(capsys)
    assert done.returncode == 0
    records = [json.loads(r) for r in job.output.read_text().splitlines()]
    written = sum(len(c["token_ids"]) for r in records for c in r["outputs"])
    assert written == 8 * 2 * 4 and f"; {written} tokens in" in done.stdout
    prompt = sum(r["prompt_tokens"] for r in records)
    assert f"computed of {2 * prompt} given" in done.stdout and "preempted" not in done.stdout


# ----- 2: every cached artefact verifies, or is rebuilt -----


def _copying_compiler(folder: Path, builds: dict[str, Path]) -> Path:
    """A stand-in for g++ that copies the host's verified build of the source it is given (seconds of g++ saved)."""
    compiler = folder / "copying-g++"
    cases = "\n".join(f'  *{name}) source={str(path)!r};;' for name, path in builds.items())
    compiler.write_text(f"""#!/bin/sh
out=; previous=; source=
for argument in "$@"; do [ "$previous" = -o ] && out=$argument; previous=$argument
  case "$argument" in
{cases}
  esac
done
exec cp "$source" "$out"
""")
    compiler.chmod(0o755)
    return compiler


def _overwrite_floats(path: Path, tensor: str, value: float, count: int) -> None:
    """``count`` floats of ``tensor`` in a safetensors file set to ``value``, in place (the audit's damage)."""
    with path.open("r+b") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        start = 8 + header_len + header[tensor]["data_offsets"][0]
        f.seek(start)
        f.write(struct.pack(f"<{count}f", *([value] * count)))


def test_each_damaged_cache_artefact_is_rebuilt_and_the_outputs_equal_a_clean_run(job, capsys, reference, monkeypatch):
    host_builds = {"paged_decode.cpp": native_attention.library_path(),
                   "exact_ops.cpp": exact_ops.native_build.library_path(exact_ops.SOURCE, exact_ops.FLAGS)}
    monkeypatch.setenv("RAYSAMPLE_CACHE_DIR", str(job.cache))  # after library_path read the host's names
    monkeypatch.setenv("CXX", str(_copying_compiler(job.folder, {k: v for k, v in host_builds.items()})))
    tiny = job.cache / "tiny" / PRESETS["default"].fingerprint()
    kernel_name = native_attention.library_path().name
    # Each damaged kernel in a folder of its own: this process keeps every library it loaded mapped, and
    # glibc hands back a loaded library for a path it loaded before (the audit ran each in a new process).
    kernel_dirs = iter(range(100))

    def new_kernel_dir() -> Path:
        folder = job.cache / f"kernels-{next(kernel_dirs)}"
        shutil.copytree(job.cache / "kernels", folder)
        monkeypatch.setenv("RAYSAMPLE_KERNEL_DIR", str(folder))
        return folder / kernel_name

    def weights() -> None:  # floats of one projection overwritten, as the audit did to SmolLM2
        _overwrite_floats(tiny / "model.safetensors", "model.layers.0.mlp.down_proj.weight", 0.37, 4096)

    def tokenizer() -> None:
        data = json.loads((tiny / "tokenizer.json").read_text())
        data["model"]["vocab"] = dict(list(data["model"]["vocab"].items())[::-1])  # ids shuffled, still valid JSON
        (tiny / "tokenizer.json").write_text(json.dumps(data))

    def kernel_truncated() -> None:
        with new_kernel_dir().open("r+b") as f:
            f.truncate(1000)

    def kernel_emptied() -> None:
        new_kernel_dir().write_bytes(b"")

    def kernel_zeroed() -> None:
        kernel = new_kernel_dir()
        data = bytearray(kernel.read_bytes())
        data[len(data) // 3: len(data) // 3 + 4096] = bytes(4096)
        kernel.write_bytes(bytes(data))

    def verdicts(value: object) -> object:
        def damage() -> None:
            for path in (job.cache / "row-tiles").glob("*.json"):
                path.write_text(value if isinstance(value, str) else json.dumps(value))
        return damage

    def probe_markers() -> None:
        for path in (job.cache / "probes").iterdir():
            path.write_text("not this model's key\n")

    damages = {"weights": weights, "tokenizer": tokenizer, "attention-probe markers": probe_markers,
               "kernel truncated": kernel_truncated,
               "kernel emptied": kernel_emptied, "kernel zeroed": kernel_zeroed,
               "verdict not JSON": verdicts("{tru"),
               "verdict of another kind": verdicts({"low": 0, "high": 0}),
               "verdict a number": verdicts(1)}
    assert list((job.cache / "row-tiles").glob("*.json")), "the host's cache has row-tile verdicts to damage"
    for name, damage in damages.items():
        damage()
        _fresh_kernels()
        output = job.folder / f"out-{name.replace(' ', '-')}.jsonl"
        done = job.run(capsys, output=output)
        assert done.returncode == 0, (name, done.stderr)
        assert tokens_by_id(output) == reference, name
    for folder in job.cache.glob("kernels-*"):  # each rebuilt to the build it was
        assert (folder / kernel_name).read_bytes() == host_builds["paged_decode.cpp"].read_bytes()
    checked_again = [json.loads(path.read_text()) for path in (job.cache / "row-tiles").glob("*.json")]
    assert True in checked_again and all(saved is True or saved == 1 for saved in checked_again)  # 1: other shapes


def test_a_damaged_converted_model_is_converted_again_or_refused_in_one_line(tmp_path, monkeypatch):
    """The real model's converted directory: damaged weights are found by their hash and converted again
    from the GGUF (the conversion itself, 15 s, stood in for by a copy of the clean directory here); with
    no way to convert, one line names the damaged file."""
    from workers.model import model_source

    clean = Path(model_source.gguf_to_transformers(model_source.preset_gguf("smollm2-135m-instruct"), "float32"))
    cache = tmp_path / "cache"
    shutil.copytree(clean, cache / "models" / clean.name)
    monkeypatch.setenv("RAYSAMPLE_CACHE_DIR", str(cache))
    damaged = cache / "models" / clean.name
    _overwrite_floats(damaged / "model.safetensors", "model.layers.0.mlp.down_proj.weight", 0.37, 16384)
    converted: list[Path] = []

    def conversion(path: Path, out: Path, stored: str) -> None:
        converted.append(path)
        for item in clean.iterdir():
            if not item.name.startswith("."):
                shutil.copy2(item, out / item.name)

    monkeypatch.setattr(model_source, "_convert", conversion)
    again = model_source.gguf_to_transformers(model_source.preset_gguf("smollm2-135m-instruct"), "float32")
    assert len(converted) == 1 and again == damaged
    assert (damaged / "model.safetensors").read_bytes() == (clean / "model.safetensors").read_bytes()
    assert model_source.gguf_to_transformers(model_source.preset_gguf("smollm2-135m-instruct"), "float32") == damaged
    assert len(converted) == 1  # verified: not converted again

    _overwrite_floats(damaged / "model.safetensors", "model.layers.0.mlp.down_proj.weight", 0.37, 16)

    def broken(path: Path, out: Path, stored: str) -> None:
        raise RuntimeError("the gguf package is gone")

    monkeypatch.setattr(model_source, "_convert", broken)
    with pytest.raises(model_source.ModelSourceError) as raised:
        model_source.gguf_to_transformers(model_source.preset_gguf("smollm2-135m-instruct"), "float32")
    assert "model.safetensors" in str(raised.value) and "\n" not in str(raised.value)


# ----- 5: a held lock is waited on, said, and bounded -----


def test_a_kernel_lock_held_by_a_live_process_is_waited_on_with_a_line_then_fails_clearly(job, capsys):
    kernel = job.cache / "kernels" / native_attention.library_path().name
    kernel.unlink()  # this start must build it, and takes its lock
    config = write_config(job.folder, lock_timeout_s=2)
    with open(kernel.with_suffix(".lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another job building it would
        held.write(f"{os.getpid()}\n")
        held.flush()
        done = job.run(capsys, config=config)
    assert done.returncode == 1
    assert f"waiting for process {os.getpid()}" in done.stderr and "cache.lock_timeout_s" in done.stderr
    assert "could not start" in done.stderr and "still held by" in done.stderr


# ----- 3: a fault every request shares is the engine's -----


def _faulty_forward(monkeypatch, kind: str, after: threading.Event) -> None:
    """Every forward of runners built from now on fails once ``after`` is set (their start-up is sound)."""
    from workers.model.model_runner import ModelRunner

    built = ModelRunner._build  # what every way of making a runner calls

    def build(self, *args, **kwargs):
        built(self, *args, **kwargs)
        sound = self.forward

        def forward(rows):
            logits = sound(rows)
            if not after.is_set():
                return logits
            if kind == "nan":
                return logits * float("nan")
            raise RuntimeError("a kernel failed")

        self.forward = forward

    monkeypatch.setattr(ModelRunner, "_build", build)


@pytest.mark.parametrize("kind", ["nan", "raises"])
def test_a_fault_every_request_shares_stops_the_job_and_a_resume_after_the_fix_runs_them(
        job, capsys, monkeypatch, reference, kind):
    broken = threading.Event()
    broken.set()
    _faulty_forward(monkeypatch, kind, broken)
    done = job.run(capsys)
    assert done.returncode == 1
    assert "the engine is broken, not the requests it ran" in one_line(done.stderr)
    finals = [r for r in map(json.loads, job.output.read_text().splitlines()) if not r.get("retryable")] \
        if job.output.exists() else []
    assert finals == []  # nothing recorded as done
    broken.clear()  # the cause is fixed
    done = job.run(capsys)
    assert done.returncode == 0 and "nothing to do" not in done.stdout
    assert {rid: v for rid, v in tokens_by_id(job.output).items()
            if v[1] is None} == reference


def test_a_request_whose_own_processor_fails_it_alone_still_fails_alone(job, capsys, reference):
    """The engine's check passes, so a poison request is still its own failure (not retried)."""
    lines = LINES + [{"id": "poison", "prompt": "x", "sampling_params": {
        "max_tokens": 30, "ignore_eos": True, "extra_args": {"boom": "late"}}}]
    job.input.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = yaml.safe_load(job.config.read_text())
    config["processors"] = [{"class": "failing_processors:BoomLate"}]  # raises naming no request
    job.config.write_text(yaml.safe_dump(config))
    done = job.run(capsys)
    assert done.returncode == 0, done.stderr
    out = tokens_by_id(job.output)
    assert "made the engine fail on its own" in out.pop("poison")[1] and out == reference

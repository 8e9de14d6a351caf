"""A job that cannot run fails on the driver in seconds, with one line, before Ray starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import pythonpath, tiny_job_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("change", "local", "message"), [
    ({"processors": ["no_such_pkg.mod:Proc"]}, False, "processors: Logits processor 'no_such_pkg.mod:Proc'"),
    ({"processors": [{"class": "nope.zoo:Thing", "request_level": True, "enable_with": "x"}]}, False,
     "request-level 'nope.zoo:Thing' cannot be imported"),
    ({"model": {"path": "/no/such/model/dir", "max_model_len": 64}}, False, "is not a directory"),
    ({"cluster": {"num_workers": 2, "gpus_per_worker": 1}}, False, "this host (address: local) sees 0"),
    ({"cluster": {"num_workers": 1, "gpus_per_worker": 1}}, True, "this process (--local) sees 0"),
])
def test_bad_jobs_fail_fast_with_one_line(tmp_path, change, local, message):
    if torch.cuda.is_available() and "gpus_per_worker" in str(change):
        pytest.skip("this host has a GPU: the GPU check passes here")
    config = tiny_job_config()
    for key, value in change.items():
        config[key] = value if key == "processors" else {**config.get(key, {}), **value}
    if "path" in config["model"]:
        config["model"].pop("tiny", None)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    proc = subprocess.run([sys.executable, "-m", "cluster.entrypoints.job", "generate", "--config", str(tmp_path / "c.yaml"),
                           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                           *(["--local"] if local else [])], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "[raysample] starting" not in proc.stdout, proc.stdout[-2000:]  # refused before any engine (or Ray) started
    assert not (tmp_path / "out.jsonl").exists()


def no_hub_call(*args, **kwargs):
    raise AssertionError(f"transformers was asked for {args[:1]} after the preflight found the hub unreachable")


def test_a_hub_id_that_cannot_be_fetched_is_one_error_at_once(tmp_path, monkeypatch):
    """A hub id (a dot in its name, as most have) not in the cache while the hub is out of reach: one line
    now, from the job and from LLM alike, not a minute of retries printed twice each; one in the cache or
    with the hub reachable passes the check."""
    from huggingface_hub import constants

    from cluster.config import load_config
    from cluster.entrypoints.llm import LLM
    from cluster.preflight import PreflightError, check_model_source, hub_unreachable

    port = closed_port()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for config, field in (({"model": {"path": "some-org/Some-Model-1.5B"}}, "model.path"),
                          ({"model": {"tiny": "default", "tokenizer": "some-org/tok.v2"}}, "model.tokenizer")):
        with pytest.raises(PreflightError, match=f"^{field} 'some-org/.*' is not a local directory and not in "
                                                 "the Hugging Face cache .* cannot be reached"):
            check_model_source(load_config(config))
    probes = []
    monkeypatch.setattr("cluster.preflight.hub_unreachable", lambda *a, **k: probes.append(a) or hub_unreachable(*a, **k))
    with monkeypatch.context() as no_loads:  # refused before transformers tries the hub (its retries took a minute)
        no_loads.setattr("transformers.AutoConfig.from_pretrained", no_hub_call)
        no_loads.setattr("transformers.AutoTokenizer.from_pretrained", no_hub_call)
        with pytest.raises(PreflightError, match="cannot be reached"):
            LLM("some-org/Some-Model-1.5B", local=True)
    assert len(probes) == 1, probes  # one probe of the hub, not one per entry point it passes through
    assert hub_unreachable(f"http://127.0.0.1:{port}") is not None
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # offline: transformers reads the cache and says what is missing
    check_model_source(load_config({"model": {"path": "some-org/Some-Model-1.5B"}}))
    with pytest.raises(PreflightError, match="is not a directory"):  # a file is not a model folder
        check_model_source(load_config({"model": {"path": str(Path(__file__))}}))


def closed_port() -> int:
    """A local port nothing listens on."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_processor_package_in_the_current_directory_gets_the_hint_the_console_script_needs(tmp_path):
    """``python -m cluster.entrypoints.job`` imports a package from the current directory; the ``raysample``
    console script does not (its own folder is first on the import path, not the current one). Its error
    says so and how to run it; the same job then runs with PYTHONPATH set."""
    import os

    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    (work / "myprocs").mkdir(parents=True)
    bin_dir.mkdir()
    (work / "myprocs" / "__init__.py").write_text("from processors.examples import DummyLogitsProcessor as Mine\n")
    (work / "c.yaml").write_text("model: {tiny: default, max_model_len: 64}\nprocessors: ['myprocs:Mine']\n")
    (work / "in.jsonl").write_text('{"id": 1, "prompt": "x", "sampling_params": {"max_tokens": 2}}\n')
    script = bin_dir / "raysample"  # as pip writes a console script
    script.write_text("import sys\nfrom cluster.entrypoints.job import cli\nsys.exit(cli())\n")
    args = [sys.executable, str(script), "generate", "--config", "c.yaml", "--input", "in.jsonl", "--output",
            "out.jsonl", "--local"]
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT)}
    refused = subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "'myprocs' is in the current directory, which the raysample command does not import from: run it as " \
           "PYTHONPATH=$PWD raysample" in refused.stderr, refused.stderr[-2000:]
    env["PYTHONPATH"] = pythonpath(ROOT, work)
    ran = subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0 and (work / "out.jsonl").exists(), ran.stderr[-2000:]


def test_a_run_reads_its_models_facts_once_on_the_llm_job_and_ray_data_paths(tmp_path, monkeypatch, capsys):
    """``prepare_run`` is where a run's config is prepared: every entry point calls it once, and what it hands
    down (the engine, the tokenizer, a dataset's engine stages, the job's formats) reads the facts it read."""
    import json

    import pyarrow as pa
    from helpers import run_job_main

    from cluster.entrypoints.data import EngineStage, build_processor
    from cluster.entrypoints.llm import LLM
    from processors import SamplingParams
    from workers.model.model_facts import ModelFacts

    reads: list[str] = []
    read = ModelFacts.read.__func__

    def counted(cls, *args, **kwargs):
        reads.append(str(args[0]))
        return read(cls, *args, **kwargs)

    monkeypatch.setattr(ModelFacts, "read", classmethod(counted))
    tiny = {"model": {"tiny": "default", "max_model_len": 64}, "cluster": {"num_workers": 1}}

    llm = LLM(config=tiny, local=True)
    llm.generate("a", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.get_tokenizer()
    llm.shutdown()
    assert len(reads) == 1, reads

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny))
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"id": 1, "prompt": "a", "sampling_params": {"max_tokens": 2}}) + "\n")
    done = run_job_main(capsys, "generate", "--local", "--config", str(config), "--input", str(lines),
                        "--output", str(tmp_path / "out.jsonl"))
    assert done.returncode == 0, done.stderr
    assert len(reads) == 2, reads

    processor = build_processor(tiny)  # the driver prepares; each engine stage takes what it prepared
    stage = EngineStage(processor.config)
    try:
        assert stage(pa.table({"prompt": ["a"]})).column("error").to_pylist() == [None]
    finally:
        stage._shutdown()
    assert len(reads) == 3, reads

"""Every code block of README.md and docs/guide.md runs as written, or is shown to be run elsewhere.

``CLAIMS`` names, for each block (by its first line), what runs it: a test in this module, or a test
elsewhere that reads the same command or block. A block without a claim fails
``test_every_block_is_claimed``, so a new snippet cannot go unrun. What a block reads is made here
(``questions.parquet``, ``my_package/``); what it writes under ``/data`` goes to a temporary folder
instead. The Ray Data blocks run on a Ray instance of 2 CPUs, the size where they used to hang once
generation was done (the engine's workers held every CPU and Ray Data's write task waited forever).
"""

from __future__ import annotations

import asyncio
import re
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/guide.md")


def blocks() -> list[tuple[str, str, str]]:
    """(file, language, text) of every fenced block."""
    found = []
    for name in DOCS:
        for lang, text in re.findall(r"```(\w*)\n(.*?)```", (ROOT / name).read_text(), re.S):
            found.append((name, lang, text))
    return found


def block(name: str, first: str) -> str:
    """The block of ``name`` whose first line starts with ``first``."""
    return next(text for file, _, text in blocks() if file == name and text.lstrip().startswith(first))


HERE = "tests/test_docs.py"
CLAIMS: dict[tuple[str, str], str] = {
    # README.md
    ("README.md", "# from vllm.v1.sample.logits_processor import"): f"{HERE}::test_readme_imports_run",
    ("README.md", "make run"): "tests/cluster/ray/test_ray_job.py::test_ray_job_submit_as_the_guide_shows_it "
                               "(configs/default.yaml's job, its printed lines counted)",
    ("README.md", "[raysample] starting"): "a transcript of make run",
    ("README.md", "job CLI / LLM / AsyncLLM"): "a diagram",
    ("README.md", ".venv/bin/raysample generate"): "tests/cluster/engine/test_real_model.py (the same config and "
                                                   "input in process) and the make run test above",
    ("README.md", '{"id": "q1"'): "tests/cluster/engine/test_real_model.py::test_readme_jsonl_examples_run_on_the_real_model",
    ("README.md", "from raysample import LLM"): "tests/workers/model/test_gguf_model.py::"
                                                "test_readme_and_guide_llm_blocks_on_ray_equal_transformers",
    ("README.md", "import ray"): f"{HERE}::test_ray_data_and_engine_blocks_on_a_2_cpu_ray",
    # docs/guide.md
    ("docs/guide.md", "make run"): "as README.md's",
    ("docs/guide.md", "[raysample] starting"): "a transcript of make run",
    ("docs/guide.md", '{"id": "q1"'): "as README.md's",
    ("docs/guide.md", "source .venv/bin/activate"): "tests/cluster/ray/test_ray_job.py::test_ray_job_submit_as_the_guide_shows_it",
    ("docs/guide.md", "ray job submit --working-dir . \\"): "tests/cluster/ray/test_ray_job.py::"
                                                            "test_a_processor_package_outside_the_repo_ships_with_py_modules",
    ("docs/guide.md", "import torch"): f"{HERE}::test_guide_processor_yaml_and_entry_point_blocks",
    ("docs/guide.md", "processors:"): f"{HERE}::test_guide_processor_yaml_and_entry_point_blocks",
    ("docs/guide.md", '[project.entry-points."vllm.logits_processors"]'):
        f"{HERE}::test_guide_processor_yaml_and_entry_point_blocks",
    ("docs/guide.md", '{"id": "a"'): "tests/cluster/engine/test_real_model.py::test_readme_jsonl_examples_run_on_the_real_model",
    ("docs/guide.md", "from raysample import LLM"): "tests/workers/model/test_gguf_model.py::"
                                                    "test_readme_and_guide_llm_blocks_on_ray_equal_transformers",
    ("docs/guide.md", "async for out in AsyncLLM"): f"{HERE}::test_async_llm_line_runs_in_an_async_function",
    ("docs/guide.md", "from raysample import Engine"): f"{HERE}::test_ray_data_and_engine_blocks_on_a_2_cpu_ray",
    ("docs/guide.md", "import ray"): f"{HERE}::test_ray_data_and_engine_blocks_on_a_2_cpu_ray",
    ("docs/guide.md", "ray job submit --working-dir . -- python examples/ray_data_parquet.py"):
        "tests/cluster/ray/test_ray_job.py::test_the_ray_data_example_runs_as_the_guide_shows_it",
    ("docs/guide.md", "scheduler:"): f"{HERE}::test_config_blocks_load",
    ("docs/guide.md", "SamplingParams(structured_outputs="): f"{HERE}::test_structured_outputs_line_runs",
    ("docs/guide.md", '{"custom_id": "s1"'): f"{HERE}::test_guide_scoring_and_adapter_jobs_run",
    ("docs/guide.md", ".venv/bin/raysample run-batch"): f"{HERE}::test_guide_scoring_and_adapter_jobs_run",
    ("docs/guide.md", '{"id": "sea-1"'): f"{HERE}::test_guide_scoring_and_adapter_jobs_run",
    ("docs/guide.md", ".venv/bin/raysample generate --config configs/default.yaml --input adapters"):
        f"{HERE}::test_guide_scoring_and_adapter_jobs_run",
}


def claim_of(name: str, text: str) -> str | None:
    first = text.lstrip()
    keys = [key for key in CLAIMS if key[0] == name and first.startswith(key[1])]
    return CLAIMS[max(keys, key=lambda k: len(k[1]))] if keys else None


def test_every_block_is_claimed_and_each_claimed_test_exists():
    unclaimed = [(name, text.splitlines()[0]) for name, _, text in blocks() if claim_of(name, text) is None]
    assert not unclaimed, f"blocks nothing runs: {unclaimed}; add a test and a claim in {HERE}"
    for name, _, text in blocks():
        claim = claim_of(name, text)
        if "::" in claim:
            path, test = claim.split(" ")[0].split("::")
            assert f"def {test}(" in (ROOT / path).read_text(), claim


def test_readme_imports_run():
    exec(compile(block("README.md", "# from vllm"), "README.md", "exec"), {})


def test_structured_outputs_line_runs():
    scope = {"schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    exec("from raysample import SamplingParams, StructuredOutputsParams", scope)
    exec(compile(block("docs/guide.md", "SamplingParams(structured_outputs="), "docs/guide.md", "exec"), scope)


def test_config_blocks_load():
    from cluster.config import load_config

    text = block("docs/guide.md", "scheduler:")
    config = load_config({"model": {"tiny": "default"}, **yaml.safe_load(text)})
    assert config.scheduler.max_num_seqs == yaml.safe_load(text)["scheduler"]["max_num_seqs"]


def test_guide_processor_yaml_and_entry_point_blocks(tmp_path, monkeypatch):
    """The guide's processor class, saved as the ``my_package.processors`` its YAML and its entry point
    name, then the YAML block as written (three processors, one of them a vLLM V0 callable from
    logits-processor-zoo) in an engine, and the entry point as an installed plugin."""
    import importlib.metadata

    from cluster.config import load_config
    from cluster.engine.local_engine import LocalEngine
    from processors import SamplingParams
    from processors.loading import load_entry_point_processors

    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "processors.py").write_text(block("docs/guide.md", "import torch"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_package", raising=False)
    config = load_config({"model": {"tiny": "default", "max_model_len": 64}, **yaml.safe_load(
        block("docs/guide.md", "processors:"))})
    engine = LocalEngine(config)
    outs = engine.generate(["a b", "c d"], [
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, extra_args={"target_token": 9}),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, extra_args={"gen_length": True})])
    assert outs[0].token_ids == [9, 9, 9, 9] and outs[1].error is None
    assert not {0, 3} & set(outs[1].token_ids)  # BannedTokensLogitsProcessor's kwargs

    entry = tomllib.loads(block("docs/guide.md", '[project.entry-points."vllm.logits_processors"]'))
    dist = tmp_path / "my_package-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-package\nVersion: 1.0\n")
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items())
             for group, points in entry["project"]["entry-points"].items()]
    (dist / "entry_points.txt").write_text("\n".join(lines))
    importlib.invalidate_caches()
    loaded = load_entry_point_processors()
    assert [cls.__module__ + ":" + cls.__name__ for cls in loaded if cls.__module__ == "my_package.processors"] == \
        ["my_package.processors:DummyLogitsProcessor"]


def test_async_llm_line_runs_in_an_async_function(monkeypatch):
    """The guide's one-line ``AsyncLLM`` stream, inside an async function as its comment says (the model
    swapped for the tiny one in this process: the real model on Ray runs in test_gguf_model)."""
    import raysample

    line = block("docs/guide.md", "async for out in AsyncLLM")
    real = raysample.AsyncLLM
    monkeypatch.setattr(raysample, "AsyncLLM", lambda model: real({"tiny": "default"}, local=True, max_model_len=64))
    printed: list[str] = []
    scope = {"AsyncLLM": raysample.AsyncLLM, "SamplingParams": raysample.SamplingParams,
             "print": lambda *a, **k: printed.append(" ".join(map(str, a)))}
    exec(compile("async def main():\n" + textwrap.indent(line, "    ") + "\n", "docs/guide.md", "exec"), scope)
    asyncio.run(scope["main"]())
    assert len(printed) == 32


@pytest.mark.ray
@pytest.mark.timeout(400)  # a hang (Ray Data's write task waiting for a CPU) fails, it does not stall the suite
def test_ray_data_and_engine_blocks_on_a_2_cpu_ray(tmp_path, monkeypatch, capsys):
    """README's and the guide's Ray Data blocks and the guide's ``Engine`` block, as written, on one Ray
    instance of 2 CPUs (configs/default.yaml: the real model in 2 workers), with the ``questions.parquet``
    they read made here and their ``/data/answers`` written to a temporary folder. A cluster the engines
    would fill: each Ray Data block's dataset is written, not left waiting for a CPU the workers hold."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    monkeypatch.chdir(ROOT)
    questions = tmp_path / "questions.parquet"
    pq.write_table(pa.table({"qid": ["q1", "q2"], "question": ["What is the capital of France?", "Name a color."]}),
                   questions)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        for name in DOCS:
            answers = tmp_path / f"answers-{Path(name).stem}"
            source = block(name, "import ray").replace('"questions.parquet"', repr(str(questions)))
            source = source.replace('"/data/answers"', repr(str(answers)))
            exec(compile(source, name, "exec"), {})
            rows = sorted(pq.read_table(answers).to_pylist(), key=lambda r: str(r.get("id")))
            assert len(rows) == 2 and all(r["error"] is None and r["finish_reason"] in ("stop", "length") for r in rows), rows
            assert all(0 < r["num_generated_tokens"] <= 64 for r in rows), rows
            assert "the engines' 2 worker(s) ask for 0.5 CPU each" in capsys.readouterr().out
            if name == "docs/guide.md":
                assert [r["id"] for r in rows] == ["q1", "q2"] and "Paris" in rows[0]["generated_text"]

        engine_block = block("docs/guide.md", "from raysample import Engine")
        lines = engine_block.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("async for"))
        streamed = "async def stream_block():\n" + textwrap.indent("\n".join(lines[at : at + 2]), "    ") + "\n"
        rest = "\n".join(lines[:at] + ["asyncio.run(stream_block())"] + lines[at + 2 :])
        scope = {"SamplingParams": __import__("raysample").SamplingParams, "asyncio": asyncio}
        exec(compile(streamed + rest, "docs/guide.md", "exec"), scope)
        assert len(scope["outs"]) == 2 and len(scope["three"]) == 3 and scope["done"]
    finally:
        ray.shutdown()


def test_guide_scoring_and_adapter_jobs_run(tmp_path, monkeypatch, capsys):
    """The guide's scoring file and its two-adapter job, as written (in this process: ``--local``), on the real
    model; the adapters its command names are built here (PEFT, seeded) where it says ``/adapters``."""
    import json
    import shlex

    from adapters import build_adapter
    from helpers import run_job_main

    from cluster.config import resolve

    monkeypatch.chdir(ROOT)
    (tmp_path / "scores.jsonl").write_text(block("docs/guide.md", '{"custom_id": "s1"'))
    command = shlex.split(block("docs/guide.md", ".venv/bin/raysample run-batch"))
    args = [str(tmp_path / a) if a.endswith(".jsonl") else a for a in command[1:]]
    done = run_job_main(capsys, *args, "--local")
    assert done.returncode == 0, done.stderr
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, (tmp_path / "scored.jsonl").read_text().splitlines())}
    scores = {cid: body["choices"][0]["logprobs"]["token_logprobs"] for cid, body in bodies.items()}
    assert all(s[0] is None and len(s) > 5 for s in scores.values())
    assert sum(scores["s1"][1:]) > sum(scores["s2"][1:])  # Paris is likelier than Rome

    base = resolve({"model": {"preset": "smollm2-135m-instruct"}}).facts.path
    for seed, (name, kind) in enumerate((("terse", "attn-r4"), ("wordy", "mlp-r8"))):
        build_adapter(base, tmp_path / "adapters" / name, kind, seed)
    (tmp_path / "adapters.jsonl").write_text(block("docs/guide.md", '{"id": "sea-1"'))
    command = shlex.split(block("docs/guide.md", ".venv/bin/raysample generate --config configs/default.yaml --input "
                                                 "adapters").replace("\\\n", " "))
    args = [str(tmp_path / a) if a.endswith(".jsonl") else a.replace("/adapters/", f"{tmp_path}/adapters/")
            for a in command[1:]]
    done = run_job_main(capsys, *args, "--local")
    assert done.returncode == 0, done.stderr
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "adapted.jsonl").read_text().splitlines())}
    assert all(r["error"] is None and r["token_ids"] for r in records.values()), records
    assert len({tuple(r["token_ids"]) for r in records.values()}) == 3  # each adapter answers its own way

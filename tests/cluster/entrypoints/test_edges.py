"""The edges a new user hits, as a table: each bad or odd input and the exact record or one-line message.

Generate and run-batch run in process on one shared tiny engine; the CLI cases stop before an
engine starts. Every table also holds good lines, which must come out as in a clean run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import tiny_job_config

from cluster.config import load_config
from cluster.engine.local_engine import LocalEngine
from cluster.entrypoints.job import main
from cluster.entrypoints.job_formats import GenerateFormat, OpenAIBatchFormat
from cluster.entrypoints.job_progress import JobCounters
from cluster.entrypoints.job_runner import run_job

BOM = b"\xef\xbb\xbf"
GOOD = {"max_tokens": 3, "seed": 1}


@pytest.fixture(scope="module")
def config():
    return load_config(tiny_job_config())


@pytest.fixture(scope="module")
def backend(config):
    return LocalEngine(config)


def run_lines(config, backend, tmp_path, lines: list[bytes], batch: bool = False) -> list[dict]:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(line + b"\n" for line in lines))
    output.unlink(missing_ok=True)
    fmt = OpenAIBatchFormat(config) if batch else GenerateFormat(config)
    run_job(config, backend, source, output, max_in_flight=8, line_format=fmt)
    return [json.loads(line) for line in output.read_text().splitlines()]


def gen(rid, **fields) -> bytes:
    return json.dumps({"id": rid, "prompt": "Hi", "sampling_params": GOOD, **fields}).encode()


def chat_line(rid, content: str, **fields) -> bytes:
    return json.dumps({"id": rid, "messages": [{"role": "user", "content": content}], "sampling_params": GOOD,
                       **fields}).encode()


GENERATE_CASES = [
    # (name, lines, {id: expected error (None: a result)} in the order records are written for errors)
    ("a BOM opening the file is skipped", [BOM + gen("bom")], {"bom": None}),
    ("stop must be text", [gen("s", sampling_params={"stop": 5})],
     {"s": "invalid sampling_params: stop must be a string or a list of strings, got int."}),
    ("extra_args and vllm_xargs together", [gen("x", extra_args={"a": 1}, vllm_xargs={"a": 2})],
     {"x": "give 'extra_args' or 'vllm_xargs' (its vLLM name), not both"}),
    ("a duplicate after a bad line", [gen("d", sampling_params={"max_tokens": 0}), gen("d")],
     {"d": ["invalid sampling_params: max_tokens must be at least 1, got 0.",
            "duplicate id 'd': an earlier line has it"]}),
    ("a duplicate after a good line", [gen("g"), gen("g", sampling_params={"max_tokens": 0})],
     {"g": [None, "duplicate id 'g': an earlier line has it"]}),
    ("a duplicate after an engine-side error", [gen("p", prompt=""), gen("p")],
     {"p": ["prompt is empty", "duplicate id 'p': an earlier line has it"]}),
    ("a regex that does not compile", [gen("r", sampling_params={"structured_outputs": {"regex": "a(b"}})],
     {"r": "structured_outputs.regex could not be compiled: Regex parsing error at position 4: "
           "The parenthesis is not closed."}),
    ("a schema that does not compile", [gen("j", sampling_params={"structured_outputs": {"json": {"type": "objectx"}}})],
     {"j": 'structured_outputs.json could not be compiled: Unsupported type "objectx"'}),
]


GENERATE_CASES += [
    ("a chat template inside chat_template_kwargs",
     [chat_line("t", "Hi", chat_template_kwargs={"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})],
     {"t": "chat_template_kwargs.chat_template is not allowed: a request cannot bring its own chat template (a "
           "template is code); the model's template renders 'messages'"}),
]


@pytest.mark.parametrize("name, lines, expected", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate_edges(config, backend, tmp_path, name, lines, expected):
    records = run_lines(config, backend, tmp_path, [*lines, gen("good")])
    by_id: dict = {}
    for record in records:
        by_id.setdefault(record["id"], []).append(record)
    assert by_id.pop("good")[0]["error"] is None
    assert len(records) == len(lines) + 1  # one record per line
    for rid, want in expected.items():
        wants = want if isinstance(want, list) else [want]
        got = sorted((r["error"] is not None, r["error"] or "") for r in by_id[rid])
        assert got == sorted((w is not None, w or "") for w in wants), by_id[rid]


def test_text_longer_than_any_prompt_that_fits_is_refused_before_tokenizing_and_memory_stays_bounded(
        config, backend, tmp_path):
    """A prompt (or chat) longer than max_model_len tokens can be, whatever it says, is refused by its
    length; a line longer than any request can need is read through in chunks, never held."""
    limits = GenerateFormat(config).limits()
    too_long = "a" * (limits.max_prompt_chars + 1)
    huge = b'{"id": "huge", "prompt": "' + b"b" * (limits.max_line_bytes + 10) + b'"}'
    records = {r["id"]: r for r in run_lines(config, backend, tmp_path, [
        gen("long", prompt=too_long), chat_line("chat", too_long),
        huge, gen("fine")])}
    assert records["long"]["error"] == (f"prompt has {len(too_long)} characters: more than fit in max_model_len=256 "
                                        f"tokens (at most {limits.max_prompt_chars} characters for this tokenizer); "
                                        "it was refused before tokenizing")
    assert records["chat"]["error"].startswith(f"'messages' hold {len(too_long)} characters: more than fit")
    assert records[None]["error"] == (f"line is {len(huge) + 1} bytes: more than any request that fits "
                                      f"max_model_len=256 tokens can need ({limits.max_line_bytes} bytes); it was "
                                      "not read")
    assert records["fine"]["error"] is None
    with pytest.raises(ValueError, match=r"^prompt has \d+ characters: more than fit"):  # the engine checks too
        backend.coordinator.tokenize(too_long)


def test_a_huge_max_tokens_stops_at_the_model_limit_and_says_length(config, backend, tmp_path):
    [record] = run_lines(config, backend, tmp_path, [gen("big", sampling_params={"max_tokens": 10**12,
                                                                                "ignore_eos": True})])
    assert record["error"] is None and record["finish_reason"] == "length"
    assert record["prompt_tokens"] + len(record["token_ids"]) == config.model.max_model_len


def batch_line(custom_id: str, url: str, body: dict) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


def test_run_batch_edges(config, backend, tmp_path):
    completions = "/v1/completions"
    lines = [
        BOM + batch_line("bom", completions, {"prompt": "Hi", "max_tokens": 2}),
        batch_line("two", completions, {"prompt": ["A", "B"], "n": 2, "max_tokens": 3, "seed": 4}),
        batch_line("a", completions, {"prompt": "A", "n": 2, "max_tokens": 3, "seed": 4}),
        batch_line("b", completions, {"prompt": "B", "n": 2, "max_tokens": 3, "seed": 4}),
        batch_line("object", "/v1/chat/completions", {"messages": [{"role": "user", "content": "JSON"}],
                                                     "response_format": {"type": "json_object"},
                                                     "max_tokens": 24, "seed": 2}),
        batch_line("dup", completions, {"prompt": "x", "max_tokens": -1}),
        batch_line("dup", completions, {"prompt": "x", "max_tokens": 2}),
        batch_line("empty-list", completions, {"prompt": [], "max_tokens": 2}),
        batch_line("template", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                       "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
        batch_line("own-template", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                           "chat_template": "{{ 1 }}"}),
    ]
    records = {}
    for record in run_lines(config, backend, tmp_path, lines, batch=True):
        records.setdefault(record["custom_id"], []).append(record)
    assert records["bom"][0]["error"] is None
    two = records["two"][0]["response"]["body"]
    choices = {c["index"]: c["text"] for c in two["choices"]}
    a, b = (records[k][0]["response"]["body"] for k in ("a", "b"))
    # OpenAI's order: prompt by prompt, n choices each; each prompt samples as its own request would... keyed
    # by its own id, so compare shapes and usage, and the tokens of a seeded prompt.
    assert sorted(choices) == [0, 1, 2, 3]
    assert [choices[0], choices[1]] == [c["text"] for c in a["choices"]]
    assert [choices[2], choices[3]] == [c["text"] for c in b["choices"]]
    assert two["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"] + b["usage"]["prompt_tokens"]
    content = records["object"][0]["response"]["body"]["choices"][0]["message"]["content"]
    assert content.lstrip().startswith("{"), content  # JSON mode is a JSON object, never [null]
    assert [r["error"] for r in records["dup"]] == ["max_tokens must be at least 1, got -1.",
                                                    "duplicate id 'dup': an earlier line has it"]
    assert records["empty-list"][0]["error"] == "body.prompt must be a string, a list of token ids, or a list of these"
    for refused in ("template", "own-template"):  # a template is code: never from an input line, however spelled
        assert records[refused][0]["response"]["status_code"] == 400
    assert records["template"][0]["error"].startswith("chat_template_kwargs.chat_template is not allowed")
    assert records["own-template"][0]["error"] == "body has unknown field(s) ['chat_template']"


# ----- the CLI: one line on stderr, exit 2, before an engine starts -----

def cli(tmp_path: Path, capsys, output: str, config_text: str | None = None) -> tuple[int, str]:
    config = tmp_path / "config.yaml"
    config.write_text(config_text if config_text is not None else yaml.safe_dump(tiny_job_config()))
    source = tmp_path / "in.jsonl"
    source.write_text(gen("a").decode() + "\n")
    code = main(["generate", "--config", str(config), "--input", str(source), "--output", output, "--local"])
    return code, capsys.readouterr().err


def test_cli_edges(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    cases = [
        (str(tmp_path), f"raysample: --output {tmp_path} cannot be written: it is a directory"),
        (str(tmp_path / "afile" / "o.jsonl"),
         f"raysample: --output {tmp_path / 'afile' / 'o.jsonl'} cannot be written: {tmp_path / 'afile'} is a file, "
         "not a directory"),
    ]
    for output, message in cases:
        code, err = cli(tmp_path, capsys, output)
        assert (code, err) == (2, message + "\n")
    code, err = cli(tmp_path, capsys, str(tmp_path / "o.jsonl"), config_text="model: [tiny\n")
    assert code == 2 and err.startswith(f"raysample: config {tmp_path / 'config.yaml'} is not valid YAML (line 2, "), err
    assert err.count("\n") == 1
    long_config = tiny_job_config()
    long_config["model"]["max_model_len"] = 4200  # the tiny model's limit is 512: refused, not lowered
    code, err = cli(tmp_path, capsys, str(tmp_path / "o.jsonl"), config_text=yaml.safe_dump(long_config))
    assert (code, err) == (2, "raysample: model.max_model_len=4200 is more than LlamaForCausalLM's limit of 512 tokens "
                              "(max_position_embeddings in its config.json); set model.max_model_len to at most 512 or "
                              "leave it unset\n")


def test_engine_failures_make_the_exit_code_non_zero(tmp_path, capsys, monkeypatch):
    """Records the engine failed (retryable) mean the job did not finish: exit 1, and say how to resume."""
    import cluster.entrypoints.job_runner as job_runner

    def engine_down(config, backend, source, output, *args, **kwargs):
        output.write_text(json.dumps({"id": "a", "error": "all raysample workers are gone", "retryable": True}) + "\n")
        return JobCounters(total_lines=1, errors=1, retryable=1)

    monkeypatch.setattr(job_runner, "run_job", engine_down)
    code, err = cli(tmp_path, capsys, str(tmp_path / "o.jsonl"))
    assert code == 1 and "1 request(s) failed because the engine did" in err and "retries them" in err


def test_python_edges():
    from processors.loading import LogitsProcessorLoadError, resolve_fqcn

    with pytest.raises(LogitsProcessorLoadError, match="^Invalid logits processor FQCN 'no_colon'"):
        resolve_fqcn("no_colon")
    with pytest.raises(LogitsProcessorLoadError, match="^Invalid logits processor FQCN ':Cls'"):
        resolve_fqcn(":Cls")
    with pytest.raises(LogitsProcessorLoadError, match="^Loaded logit processor must be a type"):
        resolve_fqcn("processors.examples:logger")
    with pytest.raises(TypeError, match="^prompts must be a string, a list of token ids"):
        LocalEngine.generate(object.__new__(LocalEngine), None)


def test_rendering_a_chat_template_is_bounded_in_time():
    """The model's template is trusted code, but a line's work through it is bounded (10 s in the job)."""
    from transformers import AutoTokenizer

    from cluster.entrypoints.chat import render_chat
    from workers.model.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("default"))
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    # 10^10 loop steps: only a bound that stops the rendering midway raises at all.
    with pytest.raises(ValueError, match="could not render these messages: rendering the chat template took more "
                                         "than 0.5s"):
        render_chat(tokenizer, [{"role": "user", "content": "Hi"}], chat_template=loops, time_limit_s=0.5)


def test_a_resumed_run_keeps_the_duplicate_rule(config, backend, tmp_path):
    """The first line with an id took it in an earlier run (it failed): in the resumed run a later line
    with that id is still a duplicate, and the first line is not run again."""
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    first = gen("e", sampling_params={"max_tokens": 0})
    source.write_bytes(first + b"\n")
    run_job(config, backend, source, output, max_in_flight=4)
    source.write_bytes(first + b"\n" + gen("e") + b"\n" + gen("f") + b"\n")
    counters = run_job(config, backend, source, output, max_in_flight=4)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(r["id"], r["error"]) for r in records] == [
        ("e", "invalid sampling_params: max_tokens must be at least 1, got 0."),
        ("e", "duplicate id 'e': an earlier line has it"), ("f", None)]
    assert counters.skipped == 1

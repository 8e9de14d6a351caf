"""The real chat model (SmolLM2-135M-Instruct, CPU, float32) through the shipped configs, in process.

Every JSONL example in the README runs here on the config the README names, and so does
``examples/prompts.jsonl`` (what ``make run`` generates); records are checked for what each
line asks. Two engines for the module: ``configs/default.yaml`` and ``configs/processors.yaml``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.engine.local_engine import LocalEngine
from cluster.entrypoints.job_formats import OpenAIBatchFormat
from cluster.entrypoints.job_records import read_records
from cluster.entrypoints.job_runner import run_job
from processors import SamplingParams
from processors.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.long  # over half a minute: scheduled early (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[3]
THINK_END = "</think>"


def readme_json_lines() -> list[str]:
    """The JSONL input examples in the README and the guide: every ```json block whose lines are
    records with an id."""
    lines = []
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "guide.md").read_text()
    for block in re.findall(r"```json\n(.*?)```", text, re.S):
        rows = [line for line in block.splitlines() if line.strip()]
        try:
            records = [json.loads(line) for line in rows]
        except json.JSONDecodeError:
            continue
        if all(isinstance(r, dict) and "id" in r for r in records):
            lines += rows
    return lines


@pytest.fixture(scope="module")
def default_engine() -> LocalEngine:
    return LocalEngine(load_config(ROOT / "configs" / "default.yaml"))


@pytest.fixture(scope="module")
def processors_engine() -> LocalEngine:
    return LocalEngine(load_config(ROOT / "configs" / "processors.yaml"))


def run_lines(engine: LocalEngine, lines: list[str], tmp_path: Path, fmt=None) -> dict:
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    format_ = fmt(engine.config) if fmt is not None else None
    run_job(engine.config, engine, source, sink, max_in_flight=16, line_format=format_)
    key = "custom_id" if fmt is OpenAIBatchFormat else "id"
    return {str(r[key]): r for r in read_records(sink)}


def test_readme_jsonl_examples_run_on_the_real_model(processors_engine, tmp_path):
    lines = readme_json_lines()
    ids = {str(json.loads(line)["id"]) for line in lines}
    assert {"q1", "7", "x", "a", "b", "c"} <= ids, ids
    records = run_lines(processors_engine, lines, tmp_path)
    assert set(records) == ids and all(r["error"] is None for r in records.values()), records
    tok = processors_engine.tokenizer
    assert records["x"]["token_ids"] == [42] * len(records["x"]["token_ids"])  # DummyLogitsProcessor
    assert all(len(p["top"]) == 2 for p in records["7"]["logprobs"])
    assert records["a"]["text"].strip()[:1] in {"1", "2", "3", "4"}  # MultipleChoiceLogitsProcessor
    # The thinking budget: "<think>" follows other text in the prompt, so the tokenizer spells it
    # differently than alone; the end is forced after exactly the budget's 4 tokens.
    thinking = records["c"]
    end_ids = tok.encode(THINK_END, add_special_tokens=False)
    assert thinking["token_ids"][4 : 4 + len(end_ids)] == end_ids, thinking
    assert THINK_END in thinking["text"] and THINK_END not in tok.decode(thinking["token_ids"][:4])


def test_thinking_markers_are_found_however_they_are_tokenized(processors_engine):
    tok = processors_engine.tokenizer
    alone, after_space = (tok.encode(t, add_special_tokens=False) for t in ("<think>", " <think>"))
    assert alone != after_space  # the reason text markers exist: ids alone would miss one of them
    for prompt in ("<think>", "Question? <think>", "Question?\n<think>", "Q:<think>"):
        out, = processors_engine.generate(prompt, SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, thinking_token_budget=2))
        assert THINK_END in out.text and THINK_END not in tok.decode(out.token_ids[:2]), (prompt, out.text)


def test_make_run_examples_give_what_each_line_asks(default_engine, tmp_path):
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()
    records = run_lines(default_engine, lines, tmp_path)
    assert all(r["error"] is None for r in records.values())
    assert "Paris" in records["capital"]["text"]
    person = json.loads(records["json"]["text"])
    assert isinstance(person["name"], str) and isinstance(person["age"], int) and set(person) == {"name", "age"}
    assert records["choice"]["text"] in ("yes", "no")
    assert records["stop"]["finish_reason"] == "stop" and records["stop"]["stop_reason"] == ", 5"
    assert ", 5" not in records["stop"]["text"] and records["stop"]["text"].startswith("1, 2, 3, 4")
    assert set(records["banana"]["token_ids"]) == {21285}
    assert len(records["two-ideas"]["outputs"]) == 2


def test_seeded_output_is_the_same_alone_and_in_a_batch_of_32(default_engine):
    tok = default_engine.tokenizer
    chat = [{"role": "user", "content": "Tell me a short story about a robot."}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone, = default_engine.generate(prompt, params)
    others = [f"Write line {i} of a poem about numbers." for i in range(31)]
    batch = default_engine.generate(others[:13] + [prompt] + others[13:],
                                    [SamplingParams(temperature=1.0, seed=i, max_tokens=16 + i % 9, ignore_eos=True)
                                     for i in range(13)]
                                    + [params]
                                    + [SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True) for _ in range(18)])
    assert batch[13].token_ids == alone.token_ids and len(alone.token_ids) == 24
    assert len({tuple(o.token_ids) for o in batch}) == 32  # the others really sampled


def test_structured_outputs_are_valid_and_complete(default_engine):
    tok = default_engine.tokenizer

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    outs = default_engine.generate(
        [chat("Describe Paris as JSON with its city and country."), chat("Give a US phone number."), chat("Is fire cold?")],
        [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema)),
         SamplingParams(temperature=0.7, seed=5, max_tokens=32,
                        structured_outputs=StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}")),
         SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))])
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    city = json.loads(outs[0].text)
    assert set(city) == {"city", "country"} and all(isinstance(v, str) for v in city.values())
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[1].text)
    assert outs[2].text in ("yes", "no")


def test_run_batch_records_on_the_real_model(default_engine, tmp_path):
    lines = [json.dumps(line) for line in (
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "max_completion_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "plain", "method": "POST", "url": "/v1/completions",
         "body": {"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.7,
                  "seed": 1, "n": 2, "stop": ["."]}},
    )]
    records = run_lines(default_engine, lines, tmp_path, OpenAIBatchFormat)
    chat = records["chat"]["response"]
    assert chat["status_code"] == 200 and records["chat"]["error"] is None
    body = chat["body"]
    assert body["object"] == "chat.completion" and "Paris" in body["choices"][0]["message"]["content"]
    assert body["model"] == "smollm2-135m-instruct"  # the name served: the model as configured
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 2 for c in content)
    # The EOS token has a logprob too (as in vLLM); the message text leaves it out.
    assert "".join(c["token"] for c in content).removesuffix("<|im_end|>") == body["choices"][0]["message"]["content"]
    plain = records["plain"]["response"]["body"]
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert all("." not in c["text"] and c["finish_reason"] in ("stop", "length") for c in plain["choices"])
    assert plain["usage"]["completion_tokens"] > 0 and plain["object"] == "text_completion"

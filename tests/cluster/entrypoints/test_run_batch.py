"""``raysample run-batch``: the OpenAI batch file format end to end (CLI, in-process engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import yaml
from helpers import run_job_main, tiny_job_config

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


LINES = [
    line("chat-n2", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "n": 2,
                           "temperature": 0.8, "seed": 1, "max_completion_tokens": 6}),
    line("chat-logprobs", CHAT, {"messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                 "logprobs": True, "top_logprobs": 2, "max_tokens": 4, "temperature": 0}),
    line("completion", COMPLETIONS, {"prompt": "The quick brown", "max_tokens": 5, "logprobs": 1, "top_k": 20,
                                     "seed": 3}),
    line("completion-ids", COMPLETIONS, {"prompt": [45, 74, 81], "max_tokens": 3, "temperature": 0}),
    line("json", CHAT, {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 60,
                        "temperature": 0, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": SCHEMA}}}),
    line("tools", CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
    line("bad-url", "/v1/embeddings", {"input": "x"}),
    line("other-model", CHAT, {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "messages": [{"role": "user",
                                                                                              "content": "Hi"}]}),
    line("bad-param", COMPLETIONS, {"prompt": "x", "temperature": -3}),
    "not json at all",
]


def run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    config = tiny_job_config()
    config["scheduler"]["max_num_seqs"] = 4
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [str(Path(sys.executable).parent / "raysample"), "run-batch", "-i", str(tmp_path / "in.jsonl"),
               "-o", str(tmp_path / "out.jsonl"), "--config", str(tmp_path / "config.yaml"), "--local", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_run_batch_chat_completions_errors_and_resume(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("\n".join(LINES) + "\n")
    proc = run(tmp_path, "--served-model-name", "tiny", "tiny-default")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in records if r["custom_id"] is not None}
    assert len(records) == len(LINES) and len(by_id) == len(LINES) - 1  # the non-JSON line has no custom_id
    n2 = by_id["chat-n2"]["response"]
    assert n2["status_code"] == 200 and n2["body"]["object"] == "chat.completion" and n2["body"]["model"] == "tiny"
    # A model this job does not serve: vLLM's 404 record, not an answer from another model under its name.
    other = by_id["other-model"]
    assert other["response"]["status_code"] == 404 and other["response"]["body"] is None
    assert other["error"] == "The model `meta-llama/Meta-Llama-3-8B-Instruct` does not exist."
    assert [c["index"] for c in n2["body"]["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in n2["body"]["choices"])
    usage = n2["body"]["usage"]
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12
    content = by_id["chat-logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(isinstance(t["token"], str) and len(t["top_logprobs"]) == 2 for t in content)
    completion = by_id["completion"]["response"]["body"]
    assert completion["object"] == "text_completion" and len(completion["choices"][0]["logprobs"]["tokens"]) == 5
    assert by_id["completion-ids"]["response"]["body"]["usage"]["prompt_tokens"] == 3
    answer = by_id["json"]["response"]["body"]["choices"][0]
    assert answer["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer["message"]["content"]), SCHEMA)
    for cid, reason in (("tools", "tool calls"), ("bad-url", "url must be"), ("bad-param", "temperature")):
        assert by_id[cid]["response"]["status_code"] == 400 and reason in by_id[cid]["error"], by_id[cid]
    bad_json = next(r for r in records if r["custom_id"] is None)
    assert bad_json["response"]["status_code"] == 400 and "not valid JSON" in bad_json["error"]

    # Finished: the resume adds nothing (its main in this process; the console script ran above).
    again = run_job_main(capsys, "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                         "--config", str(tmp_path / "config.yaml"), "--local", "--served-model-name", "tiny")
    assert again.returncode == 0, again.stderr[-3000:]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == len(LINES)

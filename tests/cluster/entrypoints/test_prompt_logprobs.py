"""Prompt logprobs (``SamplingParams.prompt_logprobs``), as vLLM returns them and lm-evaluation-harness scores
with them: the real model's equal transformers' float32 log-softmax of the same prompt, ranks included, with a
prompt longer than a step's token budget and with a cached prefix (recomputed, not skipped); through ``LLM``, the
JSONL job, run-batch's ``echo`` and Ray Data's column. On Ray: tests/cluster/ray/test_ray_job.py."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import run_job_main
from scoring import check_against, reference_logprobs

from cluster.config import resolve
from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog. A batch of requests shares one forward pass; each request "
        "keeps its own cache and its own sampling settings. Logits processors steer generation: they mask, bias or "
        "reshape the next-token distribution. Numbers like 1 2 3 4 5 appear too, and so does a question: what is "
        "the answer? Think first, then answer briefly and plainly, in one sentence at most.")


@pytest.fixture(scope="module")
def real():
    """The real model in float32, 64 tokens a step (the prompts are chunked), prefix caching on."""
    engine = LocalEngine({"model": {"preset": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 512},
                          "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 4},
                          "cache": {"kv_cache_memory": "64MiB"}})
    yield engine
    engine.shutdown()


def test_prompt_logprobs_equal_transformers_float32_log_softmax_chunked_and_with_a_cached_prefix(real):
    prompt = real.tokenizer.encode(TEXT)
    assert len(prompt) > 64  # longer than a step's token budget
    reference = reference_logprobs(real.model_path, prompt)
    plain = real.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.prompt_logprobs is None
    again = real.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    hits = real.coordinator.kv.hit_tokens
    assert hits >= 64  # the prompt's blocks are in the prefix cache
    first = real.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    check_against(reference, prompt, first.prompt_logprobs, 3, 1e-3)  # every position, though the prefix was cached
    assert real.coordinator.kv.hit_tokens == hits  # recomputed, not read from the cache
    assert first.outputs[0].token_ids[:1] == again.outputs[0].token_ids
    zero = real.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    check_against(reference, prompt, zero.prompt_logprobs, 0, 1e-3)
    assert all(zero.prompt_logprobs[i][t].logprob == first.prompt_logprobs[i][t].logprob
               for i, t in enumerate(prompt[1:], start=1))


def test_prompt_logprobs_for_the_whole_vocabulary_only_where_max_logprobs_allows(real):
    out = real.generate([[1, 2, 3]], SamplingParams(max_tokens=1, prompt_logprobs=-1))[0]
    assert out.error and "Requested prompt logprobs of 49152" in out.error and "model.max_logprobs" in out.error
    engine = LocalEngine({"model": {"tiny": "default", "max_model_len": 64, "max_logprobs": -1}})
    try:
        whole = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1, prompt_logprobs=-1))[0]
        assert [len(p) for p in whole.prompt_logprobs[1:]] == [512] * 3
    finally:
        engine.shutdown()


def test_the_job_run_batch_echo_and_ray_datas_column_carry_them(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"model": {"tiny": "default", "dtype": "float32", "max_model_len": 128},
                                      "cluster": {"num_workers": 1}, "scheduler": {"max_num_batched_tokens": 16}}))
    path = resolve({"model": {"tiny": "default"}}).facts.path
    prompt = list(range(20, 60))
    reference = reference_logprobs(path, prompt)
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"id": "a", "prompt_token_ids": prompt,
                                 "sampling_params": {"max_tokens": 2, "prompt_logprobs": 2}}) + "\n")
    done = run_job_main(capsys, "generate", "--local", "--config", str(config), "--input", str(lines), "--output",
                        str(tmp_path / "out.jsonl"))
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert record["prompt_logprobs"][0] is None and len(record["prompt_logprobs"]) == len(prompt)
    for i, entry in enumerate(record["prompt_logprobs"][1:]):
        assert entry["token_id"] == prompt[i + 1] and len(entry["top"]) == 2
        assert abs(entry["logprob"] - float(reference[i, prompt[i + 1]])) <= 1e-4
    # run-batch, as lm-evaluation-harness asks vLLM: echo with logprobs, max_tokens 0 scores the prompt alone.
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                                         "body": {"prompt": prompt, "max_tokens": m, "echo": True, "logprobs": 1,
                                                  "temperature": 0}}) + "\n"
                             for cid, m in (("score", 0), ("continue", 3))))
    done = run_job_main(capsys, "run-batch", "--local", "--config", str(config), "-i", str(batch), "-o",
                        str(tmp_path / "batch-out.jsonl"))
    assert done.returncode == 0, done.stderr
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads,
                                                               (tmp_path / "batch-out.jsonl").read_text().splitlines())}
    score = bodies["score"]["choices"][0]
    logprobs = score["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and len(logprobs["text_offset"]) == len(prompt)
    assert all(abs(lp - float(reference[i, prompt[i + 1]])) <= 1e-4
               for i, lp in enumerate(logprobs["token_logprobs"][1:]))
    assert score["text"] == "".join(logprobs["tokens"])  # the prompt's text alone
    assert score["prompt_logprobs"][0] is None and str(prompt[1]) in score["prompt_logprobs"][1]
    continued = bodies["continue"]["choices"][0]
    assert len(continued["logprobs"]["tokens"]) == len(prompt) + 3 and continued["text"].startswith(score["text"])


def test_a_ray_data_column_holds_them(tmp_path):
    import pyarrow as pa

    from cluster.entrypoints.data import EngineStage

    stage = EngineStage({"model": {"tiny": "default", "dtype": "float32", "max_model_len": 128}})
    try:
        table = stage(pa.table({"prompt_token_ids": [list(range(20, 40)), list(range(5, 9))],
                                "sampling_params": [{"max_tokens": 2, "prompt_logprobs": 1}, {"max_tokens": 2}]}))
    finally:
        stage._shutdown()
    rows = table.to_pylist()
    assert rows[0]["prompt_logprobs"][0] is None and len(rows[0]["prompt_logprobs"]) == 20
    assert rows[0]["prompt_logprobs"][1]["token_id"] == 21 and len(rows[0]["prompt_logprobs"][1]["top_token_ids"]) == 1
    assert rows[1]["prompt_logprobs"] is None


def test_logprobs_mode_raw_logits_gives_the_models_logits_and_processed_modes_are_refused():
    import torch
    from scoring import reference_model

    from cluster.config import ConfigError, load_config

    engine = LocalEngine({"model": {"tiny": "default", "dtype": "float32", "max_model_len": 64,
                                    "logprobs_mode": "raw_logits"}})
    try:
        prompt = [5, 6, 7, 8, 9]
        out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1,
                                                       prompt_logprobs=1))[0]
        with torch.inference_mode():
            logits = reference_model(str(engine.model_path))(torch.tensor([prompt])).logits[0]
    finally:
        engine.shutdown()
    for i, token in enumerate(prompt[1:]):  # position i + 1 is predicted by the logits at i
        assert abs(out.prompt_logprobs[i + 1][token].logprob - float(logits[i, token])) <= 1e-4
    sampled = out.outputs[0].token_ids[0]
    assert abs(out.outputs[0].logprobs[0][sampled].logprob - float(logits[-1].max())) <= 1e-4
    with pytest.raises(ConfigError, match="processed_logprobs' is not supported"):
        load_config({"model": {"tiny": "default", "logprobs_mode": "processed_logprobs"}})

"""LoRA adapters per request, as vLLM serves them: PEFT adapter directories of different ranks and target
modules and the base model mixed in one step give, each, transformers + peft's greedy tokens on the real model
in float32; a seeded request's bits do not depend on which adapters share its step; a bad adapter fails its
own request alone, with one line saying why; the JSONL job and run-batch pick adapters by a line's model name
(``--lora-modules``) and Ray Data by a ``model`` column. On Ray with tensor parallelism:
tests/cluster/ray/test_ray_job.py; split over ranks in plain processes: tests/workers/model/test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from adapters import build_adapter, peft_greedy
from helpers import run_job_main

from cluster.config import resolve
from cluster.engine.local_engine import LocalEngine
from cluster.entrypoints.llm import LLM
from cluster.entrypoints.llm_args import config_from_llm_args
from processors import LoRARequest, SamplingParams

pytestmark = pytest.mark.long  # over half a minute: scheduled early (tests/conftest.py)

SMOLLM = {"preset": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 256}
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378],
           [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28, 2810, 282, 3938]]
KINDS = ("attn-r4", "mlp-r8", "all-r16")


@pytest.fixture(scope="module")
def base() -> Path:
    return resolve({"model": SMOLLM}).facts.path


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {kind: build_adapter(base, root / kind, kind, seed) for seed, kind in enumerate(KINDS)}


@pytest.fixture(scope="module")
def llm():
    """The real model with up to 3 adapters in one step, prefix caching on (per adapter)."""
    engine = LLM(SMOLLM, local=True, enable_lora=True, max_loras=3, max_lora_rank=16,
                 scheduler={"max_num_seqs": 8}, cache={"kv_cache_memory": "64MiB"})
    yield engine
    engine.shutdown()


def lora(adapters: dict[str, Path], kind: str) -> LoRARequest:
    return LoRARequest(kind, KINDS.index(kind) + 1, str(adapters[kind]))


def test_three_adapters_and_the_base_model_in_one_batch_give_transformers_peft_greedy_tokens(llm, base, adapters):
    requests = [None, *(lora(adapters, k) for k in KINDS)]
    prompts = [p for p in PROMPTS for _ in requests]
    chosen = requests * len(PROMPTS)
    coordinator = llm.engine.coordinator
    steps = coordinator._step
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False,
                           lora_request=chosen)
    assert coordinator._step - steps <= 11  # all eight rows ran together: one prefill step, then one per token
    for prompt, request, out in zip(prompts, chosen, outputs):
        want = peft_greedy(base, None if request is None else request.lora_path, prompt, 10)
        assert out.error is None and out.outputs[0].token_ids == want, (request, prompt)
        assert out.lora_request == request
    for i in range(len(PROMPTS)):  # each adapter moves the model's tokens: a row run without its adapter shows
        tokens = [tuple(out.outputs[0].token_ids) for out in outputs[4 * i: 4 * i + 4]]
        assert len(set(tokens)) == 4, tokens


def test_a_seeded_request_with_an_adapter_gives_the_same_bits_alone_and_batched(llm, adapters):
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=12, logprobs=0)
    alone = llm.generate([PROMPTS[1]], seeded, use_tqdm=False, lora_request=lora(adapters, "all-r16"))[0]
    others = [None, lora(adapters, "attn-r4"), lora(adapters, "mlp-r8"), lora(adapters, "all-r16")]
    batched = llm.generate([PROMPTS[0]] * 4 + [PROMPTS[1]], [SamplingParams(temperature=0.8, max_tokens=12)] * 4 + [seeded],
                           use_tqdm=False, lora_request=others + [lora(adapters, "all-r16")])[-1]
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    assert batched.outputs[0].cumulative_logprob == alone.outputs[0].cumulative_logprob  # bit for bit
    assert [lp[t].logprob for lp, t in zip(batched.outputs[0].logprobs, batched.outputs[0].token_ids)] == \
        [lp[t].logprob for lp, t in zip(alone.outputs[0].logprobs, alone.outputs[0].token_ids)]


def test_a_bad_adapter_fails_only_its_own_request_with_one_line(llm, base, adapters, tmp_path):
    smaller = build_adapter(resolve({"model": {"tiny": "default"}}).facts.path, tmp_path / "tiny", "attn-r4", 5)
    malformed = tmp_path / "malformed"
    shutil.copytree(adapters["attn-r4"], malformed)
    (malformed / "adapter_config.json").write_text("{not json")
    dora = tmp_path / "dora"
    shutil.copytree(adapters["attn-r4"], dora)
    (dora / "adapter_config.json").write_text(json.dumps(
        {**json.loads((adapters["attn-r4"] / "adapter_config.json").read_text()), "use_dora": True}))
    torn = tmp_path / "torn"  # its header reads well (the coordinator's check passes); its weights are cut short
    shutil.copytree(adapters["mlp-r8"], torn)
    weights = torn / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    cases = {
        "missing": (LoRARequest("missing", 11, str(tmp_path / "nowhere")), "no such directory"),
        "malformed": (LoRARequest("malformed", 12, str(malformed)), "adapter_config.json cannot be read"),
        "rank": (LoRARequest("wide", 13, str(build_adapter(base, tmp_path / "wide", "wide-r32", 6))),
                 "rank 32 of model.layers.0.self_attn.o_proj is above lora.max_lora_rank=16"),
        "module": (LoRARequest("head", 14, str(build_adapter(base, tmp_path / "head", "head-r4", 7))),
                   "is for a module this model's LoRA layers do not have"),
        "shape": (LoRARequest("smaller", 15, str(smaller)), "an adapter for another model?"),
        "dora": (LoRARequest("dora", 16, str(dora)), "DoRA adapters are not supported"),
        "torn": (LoRARequest("torn", 17, str(torn)), "cannot be loaded"),
        "same-id": (LoRARequest("other", 1, str(adapters["mlp-r8"])), "lora_int_id 1 already names the adapter"),
    }
    good = [None, lora(adapters, "attn-r4"), lora(adapters, "mlp-r8")]
    requests = good + [request for request, _ in cases.values()]
    outputs = llm.engine.generate([PROMPTS[0]] * len(requests), SamplingParams(temperature=0.0, max_tokens=6),
                                  lora_request=requests)
    for request, out in zip(good, outputs):
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == peft_greedy(base, None if request is None else request.lora_path,
                                                       PROMPTS[0], 6)
    for (name, (request, words)), out in zip(cases.items(), outputs[len(good):]):
        assert out.error is not None and words in out.error and "\n" not in out.error, (name, out.error)
        assert str(request.lora_path) in out.error or name == "same-id", (name, out.error)
    assert llm.engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2), lora_request=good[1])[0].error is None


def test_adapters_wait_for_a_step_with_room_past_max_loras(tmp_path):
    """max_loras=1: two adapters never share a forward, and each request still gets its adapter's tokens."""
    path = resolve({"model": {"tiny": "default"}}).facts.path
    first = LoRARequest("a", 1, str(build_adapter(path, tmp_path / "a", "all-r16", 1)))
    second = LoRARequest("b", 2, str(build_adapter(path, tmp_path / "b", "mlp-r8", 2)))
    engine = LocalEngine({"model": {"tiny": "default", "dtype": "float32", "max_model_len": 128},
                          "lora": {"enabled": True, "max_loras": 1}})
    try:
        manager = engine.workers[0].runner.lora
        seen: list[set] = []
        prepare = manager.prepare
        manager.prepare = lambda adapters, counts: (seen.append(set(adapters) - {None}), prepare(adapters, counts))[1]
        prompt = list(range(30, 42))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = engine.generate([prompt] * 4, params, lora_request=[first, second, None, first])
        assert all(len(adapters) <= 1 for adapters in seen)
        assert set().union(*seen) == {(1, first.lora_path), (2, second.lora_path)}
        for out, request in zip(outs, [first, second, None, first]):
            assert out.outputs[0].token_ids == peft_greedy(path, request and request.lora_path, prompt, 8)
    finally:
        engine.shutdown()


def test_vllms_lora_arguments_and_what_is_refused():
    config = config_from_llm_args({"tiny": "default"}, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    assert (config.lora.enabled, config.lora.max_loras, config.lora.max_lora_rank, config.lora.max_cpu_loras) == \
        (True, 2, 8, 4)
    engine = LocalEngine({"model": {"tiny": "default", "max_model_len": 64}})
    try:
        out = engine.generate(["a"], SamplingParams(max_tokens=1), lora_request=LoRARequest("x", 1, "/nowhere"))[0]
        assert out.error.startswith("LoRA adapters need lora.enabled in the engine config")
        with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
            engine.generate(["a"], SamplingParams(max_tokens=1), lora_request="adapter")
        with pytest.raises(ValueError, match="got 2 lora_request for 1 prompts"):
            engine.generate(["a"], None, lora_request=[None, None])
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/a")


def test_the_job_and_run_batch_pick_an_adapter_by_the_lines_model_name(base, adapters, tmp_path, capsys):
    config = tmp_path / "smollm.yaml"
    config.write_text(yaml.safe_dump({"model": SMOLLM, "cluster": {"num_workers": 1},
                                      "lora": {"max_loras": 2}, "cache": {"kv_cache_memory": "32MiB"}}))
    modules = [f"sql={adapters['mlp-r8']}", f"poet={adapters['all-r16']}"]
    lines = tmp_path / "in.jsonl"
    greedy = {"max_tokens": 6, "temperature": 0}
    lines.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": "sql", "model": "sql", "prompt_token_ids": PROMPTS[0], "sampling_params": greedy},
        {"id": "poet", "model": "poet", "prompt_token_ids": PROMPTS[0], "sampling_params": greedy},
        {"id": "base", "model": "smollm2-135m-instruct", "prompt_token_ids": PROMPTS[0], "sampling_params": greedy},
        {"id": "plain", "prompt_token_ids": PROMPTS[0], "sampling_params": greedy},
        {"id": "unknown", "model": "nobody", "prompt_token_ids": PROMPTS[0]},
    ]))
    done = run_job_main(capsys, "generate", "--local", "--config", str(config), "--input", str(lines), "--output",
                        str(tmp_path / "out.jsonl"), "--lora-modules", *modules)
    assert done.returncode == 0, done.stderr
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    want = {name: peft_greedy(base, path, PROMPTS[0], 6) for name, path in
            (("sql", adapters["mlp-r8"]), ("poet", adapters["all-r16"]), ("base", None))}
    assert records["sql"]["token_ids"] == want["sql"] and records["poet"]["token_ids"] == want["poet"]
    assert records["base"]["token_ids"] == records["plain"]["token_ids"] == want["base"]
    assert records["unknown"]["error"] == "The model `nobody` does not exist."
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"custom_id": name, "method": "POST", "url": "/v1/completions",
                                         "body": {"model": name, "prompt": PROMPTS[0], "max_tokens": 6,
                                                  "temperature": 0}}) + "\n" for name in ("sql", "poet", "nobody")))
    done = run_job_main(capsys, "run-batch", "--local", "--config", str(config), "-i", str(batch), "-o",
                        str(tmp_path / "batch-out.jsonl"), "--lora-modules", *modules)
    assert done.returncode == 0, done.stderr
    responses = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "batch-out.jsonl").read_text().splitlines())}
    for name in ("sql", "poet"):
        body = responses[name]["response"]["body"]
        assert body["model"] == name and body["usage"]["completion_tokens"] == 6
    assert responses["nobody"]["response"]["status_code"] == 404
    # A module that cannot run on this model is the job's error before anything starts (as vLLM's start-up).
    done = run_job_main(capsys, "generate", "--local", "--config", str(config), "--input", str(lines), "--output",
                        str(tmp_path / "never.jsonl"), "--lora-modules", f"gone={tmp_path / 'gone'}")
    assert done.returncode == 2 and "lora.modules['gone']: LoRA adapter" in done.stderr
    assert "no such directory" in done.stderr and not (tmp_path / "never.jsonl").exists()


def test_a_ray_data_model_column_picks_the_adapter(base, adapters):
    import pyarrow as pa

    from cluster.entrypoints.data import EngineStage

    stage = EngineStage({"model": SMOLLM, "lora": {"modules": {"sql": str(adapters["mlp-r8"])}}})
    try:
        table = stage(pa.table({"prompt_token_ids": [PROMPTS[1]] * 3, "model": ["sql", None, "nobody"],
                                "sampling_params": [{"max_tokens": 5, "temperature": 0.0}] * 3}))
    finally:
        stage._shutdown()
    rows = table.to_pylist()
    assert rows[0]["generated_token_ids"] == peft_greedy(base, adapters["mlp-r8"], PROMPTS[1], 5)
    assert rows[1]["generated_token_ids"] == peft_greedy(base, None, PROMPTS[1], 5)
    assert rows[2]["error"] == "The model `nobody` does not exist."

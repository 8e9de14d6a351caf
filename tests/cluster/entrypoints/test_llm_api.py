"""The Python handle as vLLM users type it: ``LLM`` / ``AsyncLLM`` keywords, prompt forms, chat,
progress, refusals, and the same API on ``LocalEngine`` as on the Ray ``Engine`` (in process, tiny model)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

import raysample

from cluster import LLM, AsyncLLM, Engine
from cluster.engine.local_engine import LocalEngine
from cluster.entrypoints.llm_args import config_from_llm_args
from coordinator.request import FinishReason, RequestOutput
from processors import SamplingParams
from processors.examples import DummyLogitsProcessor

TINY = {"tiny": "default"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TINY, local=True, num_workers=2, max_model_len=128, max_num_seqs=8, dtype="float32",
               logits_processors=[DummyLogitsProcessor], seed=3, kv_cache_memory="8MiB")


def test_vllm_keywords_land_in_the_config(llm):
    config = llm.config
    assert config.cluster.num_workers == 2 and config.model.max_model_len == 128
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.seed == 3
    assert config.processors == [DummyLogitsProcessor] and config.model.dtype == "float32"
    assert config.cache.kv_cache_memory == 8 << 20
    assert len(llm.engine.workers) == 2


def test_config_file_plus_keywords_and_presets(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("model: {tiny: default, max_model_len: 64}\nscheduler: {max_num_seqs: 4}\n")
    config = config_from_llm_args(config=path, max_num_seqs=2, speculative_config={"num_speculative_tokens": 2})
    assert config.model.tiny == "default" and config.model.max_model_len == 64
    assert config.scheduler.max_num_seqs == 2 and config.speculative.num_speculative_tokens == 2
    assert config_from_llm_args("smollm2-135m-instruct").model.preset == "smollm2-135m-instruct"
    assert config_from_llm_args("/models/x.gguf").model.path == "/models/x.gguf"
    over = config_from_llm_args("/models/y", config=path)
    assert over.model.path == "/models/y" and over.model.tiny is None and over.model.max_model_len == 64
    assert config_from_llm_args(TINY, data_parallel_size=3).cluster.num_engines == 3
    with pytest.raises(ValueError, match=r"cluster.num_engines=2 needs Ray: the in-process engine"):
        LLM(TINY, data_parallel_size=2, local=True)
    assert config_from_llm_args(TINY, tensor_parallel_size=2).model.tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"model.tensor_parallel_size=2 needs Ray \(one process per rank\)"):
        LLM(TINY, tensor_parallel_size=2, local=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"pipeline_parallel_size": 2}, "pipeline parallelism is not supported"),
    ({"enable_lora": "yes please"}, r"lora\.enabled: Input should be a valid boolean"),
    ({"quantization": "awq"}, "quantized execution is not supported"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype other than 'auto'"),
    ({"swap_space": 4}, "unexpected keyword argument 'swap_space'"),
    ({"max_num_seqs": "many"}, r"scheduler\.max_num_seqs: Input should be a valid integer"),
])
def test_unsupported_vllm_arguments_are_refused(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        config_from_llm_args(TINY, **kwargs)
    config_from_llm_args(TINY, tensor_parallel_size=1, enable_lora=False, quantization=None)  # "off" is fine


def test_every_prompt_form_gives_the_same_output(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello there", add_special_tokens=False)
    outs = llm.generate(["Hello there", ids, {"prompt": "Hello there"}, {"prompt_token_ids": ids}], GREEDY,
                        use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids for o in outs)
    assert outs[0].prompt == "Hello there" and outs[1].prompt is None
    single, = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_params_as_dicts_and_one_per_prompt(llm):
    as_dict = llm.generate(["a b", "c d"], {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True},
                           use_tqdm=False)
    as_obj = llm.generate(["a b", "c d"], [GREEDY, GREEDY], use_tqdm=False)
    assert [o.token_ids for o in as_dict] == [o.token_ids for o in as_obj]
    mixed = llm.generate(["a b", "c d"], [GREEDY, {"max_tokens": 2, "extra_args": {"target_token": 7}}],
                         use_tqdm=False)
    assert mixed[1].token_ids == [7, 7] and mixed[0].token_ids == as_obj[0].token_ids
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, a dict of its fields"):
        llm.generate("a", "max_tokens=2", use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be a string, a list of token ids"):
        llm.generate(None)


def test_unsupported_request_arguments_are_refused(llm):
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate("a", GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="LoRA adapters need lora.enabled"):  # refused at submission, as vLLM
        llm.generate("a", GREEDY, lora_request=raysample.LoRARequest("x", 1, "/adapters/x"))
    with pytest.raises(ValueError, match="multi-modal data is not supported"):
        llm.generate({"prompt": "a", "multi_modal_data": {"image": None}}, GREEDY)
    with pytest.raises(ValueError, match="tools is not supported"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, tools=[{"type": "function"}])
    with pytest.raises(NotImplementedError, match="beam search is not supported"):
        llm.beam_search(["a"], None)


def test_progress_bar_counts_prompts_and_tokens(llm):
    bars = []

    class Bar:
        def __init__(self, total, desc, **kwargs):
            self.total, self.desc, self.n, self.postfix, self.closed = total, desc, 0, None, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=Bar)
    bar, = bars
    assert (bar.total, bar.n, bar.desc, bar.closed) == (3, 3, "Processed prompts", True)
    assert "output:" in bar.postfix and "toks/s" in bar.postfix
    llm.generate(["a"], GREEDY, use_tqdm=False)
    assert len(bars) == 1


def test_chat_renders_each_conversation_and_a_bad_one_raises_as_in_vllm(llm):
    tok = llm.get_tokenizer()
    hello = [{"role": "user", "content": "Hello"}]
    one, = llm.chat(hello, GREEDY, use_tqdm=False)
    want = tok.apply_chat_template(hello, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    assert one.prompt_token_ids == list(want)
    many = llm.chat([hello, [{"role": "user", "content": "Bye"}]], GREEDY, use_tqdm=False)
    assert [o.error for o in many] == [None, None] and many[0].token_ids == one.token_ids
    with pytest.raises(ValueError, match=r"messages\[0\]\.content"):
        llm.chat([hello, [{"role": "user"}], [{"role": "user", "content": "Bye"}]], GREEDY, use_tqdm=False)
    assert all(r.finished for r in llm.engine.coordinator.rows.values())  # nothing was left running
    no_prompt, = llm.chat(hello + [{"role": "assistant", "content": "Hi"}], GREEDY, use_tqdm=False,
                          add_generation_prompt=False, continue_final_message=True)
    assert no_prompt.error is None and len(no_prompt.prompt_token_ids) > len(one.prompt_token_ids)
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat("Hello")


def test_what_vllm_refuses_at_submission_raises_and_runs_nothing(llm, caplog):
    """vLLM's LLM.generate raises ValueError for a request it refuses when adding it, and aborts the ones
    added before it; a request that fails while running keeps its error in its output, and one warning
    line says how many did."""
    ok = [1, 2, 3]
    too_long = list(range(1, 129))  # max_model_len is 128: no room for one token after it
    with pytest.raises(ValueError, match=r"^The decoder prompt \(length 128\) plus the number of requested output "
                                         r"tokens \(at least 1\) is longer than the maximum model length of 128"):
        llm.generate([{"prompt_token_ids": ok}, {"prompt_token_ids": too_long}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="^Requested sample logprobs of 50, which is greater than max allowed: 20"):
        llm.generate(["a", "b"], [GREEDY, SamplingParams(max_tokens=3, logprobs=50)], use_tqdm=False)
    with pytest.raises(ValueError, match="target_token must be a non-negative integer token id"):  # validate_params
        llm.generate("a", SamplingParams(max_tokens=3, extra_args={"target_token": -4}), use_tqdm=False)
    assert all(r.finished for r in llm.engine.coordinator.rows.values())  # the ones beside them were aborted
    assert llm.generate({"prompt_token_ids": ok}, GREEDY, use_tqdm=False)[0].error is None

    from cluster.entrypoints.llm import LLM as _LLM

    failing = _LLM(TINY, local=True, max_model_len=64, logits_processors=["failing_processors:BoomAdapter"])
    try:
        with caplog.at_level("WARNING", logger="raysample"):
            outs = failing.generate(["a", "b"], [GREEDY, SamplingParams(max_tokens=4, extra_args={"boom": "apply"})],
                                    use_tqdm=False)
    finally:
        failing.shutdown()
    assert outs[0].error is None and outs[1].finish_reason == FinishReason.ERROR and outs[1].error
    warnings = [r.getMessage() for r in caplog.records if r.name == "raysample"]
    assert len(warnings) == 1 and warnings[0].startswith("1 of 2 requests failed while running"), warnings


def test_local_engine_and_engine_have_the_same_api():
    for name in ("submit", "submit_many", "poll", "abort", "results", "generate", "stream"):
        local, ray_side = getattr(LocalEngine, name), getattr(Engine, name)
        assert inspect.signature(local) == inspect.signature(ray_side), name
        assert inspect.isasyncgenfunction(local) == inspect.isasyncgenfunction(ray_side), name


def test_local_engine_submit_poll_and_stream(llm):
    engine: LocalEngine = llm.engine
    rid = engine.submit("Hello", GREEDY)
    assert isinstance(rid, str)
    seen: list[RequestOutput] = []
    while not (seen and seen[-1].finished):
        seen += engine.poll([rid], 1.0)
    assert seen[-1].token_ids == llm.generate("Hello", GREEDY, use_tqdm=False)[0].token_ids
    with pytest.raises(KeyError):
        engine.poll([rid], 0.0)  # its final output was delivered

    async def first_two() -> list[RequestOutput]:
        got = []
        async for out in engine.stream("Hello", SamplingParams(max_tokens=50, ignore_eos=True), "early"):
            got.append(out)
            if len(got) == 2:
                break  # leaving the loop aborts the request, as on Ray
        return got

    got = asyncio.run(first_two())
    assert [len(o.new_token_ids) for o in got] == [1, 1]
    final, = engine.poll(["early"], 1.0, finished_only=True)
    assert final.finish_reason == FinishReason.ABORT and len(final.token_ids) < 50


def test_async_llm_streams_one_prompt():
    engine = AsyncLLM(TINY, local=True, max_model_len=64)

    async def collect() -> list[RequestOutput]:
        return [out async for out in engine.generate("Hello", GREEDY, request_id="a1")]

    outs = asyncio.run(collect())
    assert [o.request_id for o in outs] == ["a1"] * 6 and outs[-1].finished
    assert sum(len(o.new_token_ids) for o in outs) == 6 and "".join(o.new_text for o in outs) == outs[-1].text

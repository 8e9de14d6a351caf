"""Real architectures: greedy equals transformers ``generate`` (eager attention), or the model is refused.

Random tiny versions of 15 decoder architectures, built with
``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config``. Prompts are
longer than every sliding window and are prefilled in chunks under a small
token budget with 4-token blocks, so windows, soft-capping, sinks, MoE
routing, paged gathers and chunk boundaries are all exercised.
"""

from __future__ import annotations

import random

import pytest
import torch
from arch_zoo import ARCHITECTURES, WINDOW, arch_config, build_arch_model
from transformers import AutoModelForCausalLM

from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams
from workers.model.model_runner import ModelRunner
from workers.model.model_support import check_model_config
from workers.model.paged_attention import UnsupportedAttention

pytestmark = pytest.mark.long  # over half a minute: scheduled early (tests/conftest.py)

MAX_TOKENS = 12


def prompts(vocab: int = 512) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (3 * WINDOW, 2 * WINDOW + 3, WINDOW + 5)]


def eager_greedy(path, prompt: list[int], **overrides) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **overrides)
    out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_for(path, decode_attention: str = "auto") -> LocalEngine:
    return LocalEngine({
        "model": {"path": str(path), "max_model_len": 128, "dtype": "float32", "decode_attention": decode_attention},
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 20},
        "cache": {"block_size": 4},
    })


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_greedy_matches_eager_generate(model_type):
    path = build_arch_model(model_type)
    engine = engine_for(path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = engine.generate(prompts(), params)
    for prompt, out in zip(prompts(), outputs):
        assert out.error is None, out.error
        assert out.token_ids == eager_greedy(path, prompt), (model_type, len(prompt))


@pytest.mark.parametrize("decode_attention", ["native", "torch", "flex"])
@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss", "mistral", "qwen2"])
def test_shared_prefix_blocks_match_eager_generate(model_type, decode_attention):
    """Prompts sharing 24 tokens: decode reads the shared blocks once for every row (prefix cache hits).

    Every attention path: the native CPU kernel (the default here), torch's block-major one, and FlexAttention
    over the pool (the GPU's, here in torch's dense reference)."""
    path = build_arch_model(model_type)
    engine = engine_for(path, decode_attention)
    assert engine.workers[0].runner.native_decode == (decode_attention == "native")
    assert engine.workers[0].runner.flex == (decode_attention == "flex")
    rng = random.Random(11)
    prefix = [rng.randrange(5, 512) for _ in range(24)]
    shared = [prefix + [rng.randrange(5, 512) for _ in range(n)] for n in (1, 5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = engine.generate(shared, params)
    assert engine.coordinator.kv.hit_tokens > 0
    for prompt, out in zip(shared, outputs):
        assert out.token_ids == eager_greedy(path, prompt), (model_type, len(prompt))


@pytest.mark.parametrize(("model_type", "disabled"), [
    ("mistral", {"sliding_window": None}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"sliding_window": 10_000}),
    ("gemma3_text", {"sliding_window": 10_000}),
])
def test_features_change_the_output(model_type, disabled):
    """The test above is sensitive: ignoring the feature would change the greedy output."""
    path = build_arch_model(model_type)
    changed = [eager_greedy(path, p) != eager_greedy(path, p, **disabled) for p in prompts()]
    assert any(changed), f"{model_type}: {disabled} does not matter on these prompts"


def test_length_dependent_rope_refused_beyond_its_original_length():
    config = arch_config("phi3", rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                  "long_factor": [4.0] * 8, "original_max_position_embeddings": 64},
                         original_max_position_embeddings=64)
    check_model_config(config, max_model_len=64)  # fine: never beyond the original length
    with pytest.raises(UnsupportedAttention, match="longrope.*max_model_len <= 64"):
        check_model_config(config, max_model_len=128)


def test_chunked_attention_layers_refused():
    from transformers import AutoConfig

    with pytest.raises(UnsupportedAttention, match="chunked_attention"):
        check_model_config(AutoConfig.for_model("llama4_text"), max_model_len=128)


@pytest.mark.parametrize(("feature", "message"), [
    ({"num_kv_shared_layers": 4}, "KV sharing across layers"),
    ({"alibi": True}, "ALiBi"),
    ({"position_embedding_type": "alibi"}, "ALiBi"),
])
def test_declared_features_the_runner_lacks_are_refused(feature, message):
    with pytest.raises(UnsupportedAttention, match=message):
        check_model_config(arch_config("llama", **feature), max_model_len=128)


@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_models_that_bypass_the_attention_interface_are_refused(tmp_path, model_type):
    """ALiBi models ignore a custom attention function (transformers only warns): refused at load."""
    from transformers import AutoConfig

    shape = {"bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
             "mpt": {"d_model": 64, "n_layers": 2, "n_heads": 4}}[model_type]
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=512, **shape)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedAttention, match="AttentionInterface|differ from eager"):
        ModelRunner(tmp_path, "cpu", "float32", max_model_len=64, kv_cache_memory=1 << 20, block_size=4)


def test_budget_too_small_for_one_sequence_names_the_numbers():
    path = build_arch_model("llama")
    with pytest.raises(ValueError, match=r"holds 3 blocks of 4 tokens .* max_model_len=128 needs 32"):
        ModelRunner(path, "cpu", "float32", max_model_len=128, block_size=4,
                    kv_cache_memory=3 * 2 * 2 * 4 * 2 * 16 * 4)


def test_the_probe_runs_once_per_model_code_and_layout(tmp_path, monkeypatch):
    """A worker skips the seconds-long probe when this exact model, code and layout passed it on
    this host; anything that could change its outcome probes again."""
    from workers.model import attention_probe
    monkeypatch.setenv("RAYSAMPLE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = attention_probe.verify_against_eager
    monkeypatch.setattr(attention_probe, "verify_against_eager", lambda runner: calls.append(1) or real(runner))
    path = build_arch_model("llama")

    def load(**kwargs):
        return ModelRunner(path, "cpu", "float32", max_model_len=64, kv_cache_memory=1 << 20, **kwargs)

    load(block_size=4)
    load(block_size=4)
    markers = [p for p in (tmp_path / "cache" / "probes").iterdir() if p.suffix != ".lock"]  # and its lock
    assert len(calls) == 1 and len(markers) == 1
    load(block_size=8)  # another layout
    load(block_size=4, decode_attention="torch")  # another attention path
    load(block_size=4, trust_remote_code=True)  # remote code may change: never cached
    assert len(calls) == 4


@pytest.mark.parametrize(("model_type", "merged"), [("qwen2", 2), ("qwen3", 2), ("gemma2", 0)])
def test_the_static_path_merges_layers_by_their_structure_and_keeps_the_greedy_tokens(model_type, merged, caplog):
    """The fixed-shape forward (``enforce_eager: false``, the compiled proof of a GPU's graphs) on merged
    layers: Qwen2 (q/k/v bias, a sliding-window layer) and Qwen3 (per-head q/k norms) are merged, decided by
    their parts and checked against the layers as written; Gemma2 (four norms) keeps its own layers, with
    one line saying why. All give transformers' eager greedy tokens."""
    path = build_arch_model(model_type)
    engine = LocalEngine({
        "model": {"path": str(path), "max_model_len": 128, "dtype": "float32", "enforce_eager": False},
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 20}, "cache": {"block_size": 4}})
    try:
        layers = engine.workers[0].runner.model.model.layers
        assert sum(hasattr(layer.self_attn, "qkv_proj") for layer in layers) == merged
        if not merged:
            assert "keep their own forward" in caplog.text and "post_feedforward_layernorm" in caplog.text
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for prompt, out in zip(prompts(), engine.generate(prompts(), params)):
            assert out.token_ids == eager_greedy(path, prompt), (model_type, len(prompt))
        assert engine.workers[0].runner.static.compiled_graphs > 0
    finally:
        engine.shutdown()

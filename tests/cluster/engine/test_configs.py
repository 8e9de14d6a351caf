"""Every shipped config loads; bad configs name the key path and the expected type."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config
from processors import ProcessorSpec

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("name", ["default.yaml", "gpu.yaml", "processors.yaml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.processors
    assert config.engine_config().scheduler_config.max_num_seqs == config.scheduler.max_num_seqs


def test_gpu_config_is_one_worker_per_gpu_with_spec_and_reasoning():
    config = load_config(CONFIGS / "gpu.yaml")
    assert config.cluster.gpus_per_worker == 1 and config.model.path
    assert config.speculative is not None and config.reasoning is not None


def test_compiled_graph_auto_is_on_for_gpu_workers_only():
    """Its channels busy-wait; on CPU workers that spinning takes cores from the model."""
    def cluster(**settings):
        return load_config({"model": {"tiny": "micro"}, "cluster": settings}).cluster

    assert cluster().compiled_graph == "auto" and not cluster().use_compiled_graph()
    assert cluster(gpus_per_worker=1).use_compiled_graph()
    assert cluster(compiled_graph=True).use_compiled_graph()
    assert not cluster(gpus_per_worker=1, compiled_graph=False).use_compiled_graph()
    with pytest.raises(ConfigError, match="compiled_graph"):
        cluster(compiled_graph="sometimes")


def test_processor_items_become_specs():
    config = load_config(CONFIGS / "processors.yaml")
    specs = config.custom_processors()
    assert specs[0] == "processors.examples:DummyLogitsProcessor"
    banned = specs[2]
    assert isinstance(banned, ProcessorSpec) and banned.kwargs == {"banned_token_ids": [0, 3]}
    zoo = specs[3]
    assert zoo.processor == "processors.builtins.request_level:RequestLevelAdapter"
    assert zoo.kwargs["target"] == "logits_processor_zoo.vllm:GenLengthLogitsProcessor"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model": {"tiny": "default"}, "scheduler": {"max_num_seq": 4}}, r"scheduler\.max_num_seq: Extra inputs are not permitted"),
        ({"model": {"tiny": "default"}, "scheduler": {"max_num_seqs": "many"}},
         r"scheduler\.max_num_seqs: Input should be a valid integer.*\(got 'many'\)"),
        ({"model": {"tiny": "default"}, "cluster": {"gpus_per_worker": -1}}, r"cluster\.gpus_per_worker: Input should be greater than or equal to 0"),
        ({"model": {}}, r"model: Value error, give exactly one of model\.path"),
        ({"model": {"tiny": "default"}, "processors": [{"class": "x:Y", "request_level": True}]},
         r"processors\.0: Value error, a request_level processor needs enable_with"),
        ({"model": {"tiny": "default"}, "defaults": {"temperature": 5}}, r"defaults: Value error, temperature must be in \[0, 2\], got 5"),
        ({"model": {"tiny": "default"}, "speculative": {"num_speculative_tokens": 0}},
         r"speculative\.num_speculative_tokens: Input should be greater than or equal to 1"),
        ({"model": {"tiny": "default"}, "speculative": {"draft_policy": "always"}},
         r"speculative\.draft_policy: Input should be 'adaptive' or 'fixed'"),
        ({}, r"model: Field required"),
    ],
)
def test_bad_config_messages_name_key_and_type(config, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config)


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_python_configs_take_processor_classes_as_vllm_does():
    """LLM(logits_processors=[Cls]) in vLLM; here classes, {class, kwargs} with a class, and strings."""
    from cluster.engine.local_engine import LocalEngine
    from processors import SamplingParams
    from processors.examples import BannedTokensLogitsProcessor, DummyLogitsProcessor

    engine = LocalEngine({
        "model": {"tiny": "default", "max_model_len": 64},
        "scheduler": {"max_num_seqs": 2},
        "processors": [DummyLogitsProcessor,
                       {"class": BannedTokensLogitsProcessor, "kwargs": {"banned_token_ids": [42]}}],
        "processors_from_entry_points": False,
    })
    target, banned = engine.generate(
        ["Hello", "Hello"],
        [SamplingParams(max_tokens=4, extra_args={"target_token": 9}),
         SamplingParams(max_tokens=4, extra_args={"target_token": 42})],
    )
    assert target.token_ids == [9, 9, 9, 9]
    assert 42 not in banned.token_ids  # the ban (from kwargs) wins over the target
    names = [type(p).__name__ for p in engine.workers[0].sampler.logitsprocs.all]
    assert names[3:] == ["DummyLogitsProcessor", "BannedTokensLogitsProcessor"]

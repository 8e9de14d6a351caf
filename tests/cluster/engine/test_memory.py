"""A vLLM user's first line runs: the KV cache comes from the node's memory, never more than it has.

The rule (``cluster/memory.py``) as arithmetic first, then the real model through ``LLM(model)`` with no
other argument, in process and on a private Ray instance (a subprocess, as a user runs it), and a
budget larger than the machine refused before anything is allocated. Two engines sharing one node
are checked in ``tests/cluster/ray/test_data_parallel.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.memory import RUNTIME_BYTES, GiB, MemoryPlanError, ModelMemory, plan_cpu_memory
from workers.model.tiny import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[3]
MODEL = ModelMemory(weights=GiB // 2, kv_per_token=46080, max_model_len=8192)  # SmolLM2-135M in float32


def config(**cache):
    return load_config({"model": {"preset": "smollm2-135m-instruct"}, "cache": cache})


def test_by_default_half_of_the_node_after_the_weights_is_shared_by_its_workers():
    plan = plan_cpu_memory(config(), MODEL, node_memory=16 * GiB, workers_on_node=2)
    assert plan.kv_cache_memory == int(0.5 * (16 * GiB - 2 * MODEL.weights) // 2)  # 3.75 GiB each
    assert plan.worker_memory == MODEL.weights + plan.kv_cache_memory + RUNTIME_BYTES
    assert "computed: half of the 16.00 GiB available on the node once its 2 worker(s) hold their weights" in plan.note


def test_every_row_at_full_length_caps_it_and_a_given_utilization_or_budget_overrides_it():
    roomy = plan_cpu_memory(config(), MODEL, node_memory=512 * GiB, workers_on_node=1)
    assert roomy.kv_cache_memory == 64 * 8192 * 46080 and "capped by 64 rows at max_model_len=8192" in roomy.note
    used = plan_cpu_memory(config(gpu_memory_utilization=0.9), MODEL, node_memory=16 * GiB, workers_on_node=2)
    assert used.kv_cache_memory == int((0.9 * 16 * GiB - 2 * MODEL.weights) // 2)
    assert "cache.gpu_memory_utilization=0.9 of" in used.note
    given = plan_cpu_memory(config(kv_cache_memory="1GiB"), MODEL, node_memory=16 * GiB, workers_on_node=2)
    assert given.kv_cache_memory == GiB and "given (cache.kv_cache_memory)" in given.note


def test_a_budget_the_node_cannot_hold_or_that_holds_no_request_is_one_line_naming_the_settings():
    with pytest.raises(MemoryPlanError, match=r"^cache.kv_cache_memory=1024.00 GiB per worker is more than the "
                                              r"node holds: 2 worker\(s\) x .* lower cache.kv_cache_memory"):
        plan_cpu_memory(config(kv_cache_memory="1TiB"), MODEL, node_memory=16 * GiB, workers_on_node=2)
    with pytest.raises(MemoryPlanError, match=r"one request of model.max_model_len=8192 needs 8192 .*lower "
                                              r"model.max_model_len, or raise cache.kv_cache_memory"):
        plan_cpu_memory(config(), MODEL, node_memory=int(1.5 * GiB), workers_on_node=2)


def test_the_model_facts_come_from_its_config_without_loading_weights():
    from workers.model.model_source import gguf_to_transformers, preset_gguf

    from workers.model.model_facts import ModelFacts

    path = str(gguf_to_transformers(preset_gguf("smollm2-135m-instruct"), "float32"))
    model = ModelFacts.read(path, None, None)
    memory = ModelMemory.of(model, "float32")
    assert memory.max_model_len == 8192 and memory.kv_per_token == 2 * 30 * 3 * 64 * 4
    assert 130e6 * 4 < memory.weights < 140e6 * 4  # 134.5M parameters, tied embeddings counted once
    # The weights' size read from the files (no torch): what a model built on the meta device says.
    assert memory == ModelMemory.built_on_meta(model, "float32")
    short = ModelFacts.read(path, None, 1024)
    assert ModelMemory.of(short, "bfloat16") == ModelMemory.built_on_meta(short, "bfloat16")
    tiny = ModelFacts.read(str(ensure_tiny_model("default")), None, None)
    assert ModelMemory.of(tiny, "float32") == ModelMemory.built_on_meta(tiny, "float32")


def test_llm_with_only_a_model_answers_in_process():
    from cluster import LLM
    from processors import SamplingParams

    llm = LLM("smollm2-135m-instruct", local=True)
    summary = llm.engine.coordinator.kv_summary()
    assert "max_model_len=8192" in summary and "computed: half of the" in summary, summary
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert "Paris" in out.outputs[0].text


@pytest.mark.ray
def test_llm_with_only_a_model_answers_on_ray_and_a_budget_larger_than_the_machine_is_refused():
    """As a user runs it: a fresh process, a private Ray instance, nothing but the model named."""
    script = textwrap.dedent("""
        from cluster import LLM
        from cluster.memory import MemoryPlanError
        from processors import SamplingParams
        try:
            LLM("smollm2-135m-instruct", kv_cache_memory="1TiB")
        except MemoryPlanError as exc:
            print("REFUSED", exc)
        llm = LLM("smollm2-135m-instruct")
        print("STATS", llm.engine.stats()["kv_cache"])
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
        print("ANSWER", out[0].outputs[0].text)
        llm.shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
    assert lines["REFUSED"].startswith("cache.kv_cache_memory=1024.00 GiB per worker is more than the node holds")
    assert "computed: half of the" in lines["STATS"] and "available to Ray actors on the node" in lines["STATS"]
    assert "Paris" in lines["ANSWER"]

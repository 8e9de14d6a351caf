"""The GPU's memory plan (workers/model/memory_plan.py), computed on the meta device before any weight
loads: weights, the largest step's activations (bounded by the token budget and the graphs' largest
capture, not by rows x max_model_len), then the KV cache; a start that cannot fit says so in one line
with the numbers and the max_model_len that would."""

from __future__ import annotations

import pytest

from cluster.config import load_config, resolve
from cluster.memory import gpu_memory_plan
from workers.model.memory_plan import GpuMemoryError

GB = 10**9  # cards are sold in decimal gigabytes: an "80 GB" H100 reports 79.6e9 bytes, about 74 GiB


def plan_for(preset: str, max_model_len: int, device_bytes: int, rows: int = 256):
    config = resolve(load_config({"model": {"tiny": preset, "dtype": "bfloat16", "max_model_len": max_model_len},
                                  "cluster": {"gpus_per_worker": 1}, "scheduler": {"max_num_seqs": rows}}))
    return gpu_memory_plan(config, device_bytes)


def test_llama3_8b_at_its_131k_default_starts_on_an_80_gb_card():
    plan = plan_for("llama3-8b-shape", 131072, 80 * GB).check()
    assert 15 * 2**30 < plan.weights < 17 * 2**30  # 8.0e9 bfloat16 parameters, and the runtime
    assert plan.activations < 2 * 2**30  # bounded by the step's tokens, not 256 rows x 131k keys
    assert plan.per_block == 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, 16 tokens
    assert plan.longest >= 3 * 131072  # three whole 131k-token sequences at once


def test_a_start_that_cannot_fit_names_the_numbers_and_the_max_model_len_that_would():
    with pytest.raises(GpuMemoryError) as refused:
        plan_for("llama3-8b-shape", 131072, 24 * GB).check()
    line = str(refused.value)
    assert "\n" not in line and "max_model_len=131072" in line and "GiB of weights" in line
    fits = int(line.split("max_model_len=")[-1].split()[0])
    assert 0 < fits < 131072 and fits % 16 == 0
    assert plan_for("llama3-8b-shape", fits, 24 * GB).check().longest >= fits  # and it does fit


def test_the_activation_estimate_grows_with_the_step_not_with_the_context():
    short, long = plan_for("qwen2.5-7b-shape", 4096, 80 * GB), plan_for("qwen2.5-7b-shape", 32768, 80 * GB)
    assert long.activations < 1.5 * short.activations  # 8x the context: the block mask's table grows, no more

"""The load-time attention probe: it tests the paged implementation, not a dtype's rounding.

A correct paged attention passes in float32, bfloat16 and float16; one that is wrong is refused in
every dtype, whether it is wrong everywhere (caught against eager attention in float32) or only in
a lower precision (caught against the spread of transformers' own attention implementations).
"""

from __future__ import annotations

import pytest
import torch
from arch_zoo import build_arch_model
from transformers import AttentionInterface

from workers.model import attention_probe, paged_attention
from workers.model.model_runner import ModelRunner
from workers.model.paged_attention import ATTENTION_NAME, UnsupportedAttention

DTYPES = ["float32", "bfloat16", "float16"]


def load(dtype: str) -> ModelRunner:
    return ModelRunner(build_arch_model("llama"), "cpu", dtype, max_model_len=64, kv_cache_memory=1 << 20,
                       block_size=4, verify=False)


@pytest.fixture
def broken_attention():
    """Registers a wrapped paged attention under our name for the test; the real one is put back after."""
    def install(wrong_when):
        def wrapped(module, query, key, value, attention_mask, scaling=None, **kwargs):
            out, _ = paged_attention.paged_attention(module, query, key, value, attention_mask, scaling, **kwargs)
            if wrong_when(query.dtype):
                rows = out.shape[1]  # (1, N, heads, d): each token attends as if it were the one before
                out = torch.cat([out[:, :1], out[:, : rows - 1]], dim=1)
            return out, None

        AttentionInterface.register(ATTENTION_NAME, wrapped)

    yield install
    paged_attention.register_paged_attention()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_real_paged_attention_passes_in_every_dtype(dtype):
    attention_probe.verify_against_eager(load(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_attention_wrong_everywhere_is_refused_in_every_dtype(dtype, broken_attention):
    runner = load(dtype)
    broken_attention(lambda _: True)
    with pytest.raises(UnsupportedAttention, match="differ from eager attention in float32"):
        attention_probe.verify_against_eager(runner)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_attention_wrong_only_in_low_precision_is_refused_in_that_precision(dtype, broken_attention):
    runner = load(dtype)
    broken_attention(lambda query_dtype: query_dtype != torch.float32)
    with pytest.raises(UnsupportedAttention, match=rf"differ from eager attention \(in torch.{dtype}, where "
                                                   r"transformers' own attentions differ by"):
        attention_probe.verify_against_eager(runner)


def test_the_float32_copy_restores_the_original_weights_exactly():
    runner = load("bfloat16")
    def dense(t: torch.Tensor) -> torch.Tensor:  # weights prepacked for oneDNN (native-bf16 CPUs) are opaque
        return t.to_dense() if t.is_mkldnn else t.clone()

    before = {name: dense(t) for name, t in runner.model.state_dict().items()}
    buffers = {name: t.dtype for name, t in runner.model.named_buffers()}
    attention_probe.verify_against_eager(runner)
    after = {name: dense(t) for name, t in runner.model.state_dict().items()}
    assert all(torch.equal(before[name], after[name]) and before[name].dtype == after[name].dtype for name in before)
    assert {name: t.dtype for name, t in runner.model.named_buffers()} == buffers  # RoPE's float32 inv_freq too
    assert runner.dtype == torch.bfloat16 and runner.cache is not None and runner.cache.keys[0].dtype == torch.bfloat16


def test_workers_that_start_together_verify_once(tmp_path, monkeypatch):
    """A cold host: one of the workers that start together runs the probe, the others wait for its marker."""
    import threading
    import time

    monkeypatch.setenv("RAYSAMPLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention_probe, "probe_key", lambda runner, path, trust: "the-key")
    calls: list[object] = []

    def verify(runner):
        calls.append(runner)
        time.sleep(0.3)

    monkeypatch.setattr(attention_probe, "verify_against_eager", verify)
    from types import SimpleNamespace

    runners = [SimpleNamespace(model=torch.nn.Identity()) for _ in range(4)]
    threads = [threading.Thread(target=attention_probe.verify_once, args=(runner, "model")) for runner in runners[:3]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(calls) == 1 and (tmp_path / "probes" / "the-key").is_file()
    attention_probe.verify_once(runners[3], "model")
    assert len(calls) == 1

"""Fused CPU layers compute what the prepacked layers compute, bit for bit, or are not used."""

from __future__ import annotations

import pytest
import torch
from arch_zoo import build_arch_model
from torch import nn
from transformers import AutoModelForCausalLM

from workers.cpu import exact_ops
from workers.cpu.cpu_fusion import SharedInputLinears, SharedInputMember, fuse_cpu_layers
from workers.cpu.cpu_linear import prepack_available, prepack_linears

pytestmark = pytest.mark.skipif(not prepack_available(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("model_type,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                              ("qwen3", torch.float32), ("qwen3", torch.bfloat16),
                                              ("gemma2", torch.float32), ("starcoder2", torch.float32),
                                              ("gpt2", torch.float32)])
def test_fused_model_gives_the_prepacked_models_logits_bit_for_bit(model_type, dtype):
    if not prepack_available(torch.device("cpu"), dtype):
        pytest.skip(f"no native oneDNN {dtype} on this CPU: the runner does not fuse there")
    path = build_arch_model(model_type)
    prepacked = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    fused = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        prepack_linears(prepacked)
        counts = fuse_cpu_layers(fused)
        for length in (1, 40):  # one decode token; a prompt
            ids = torch.randint(5, 500, (1, length), generator=torch.Generator().manual_seed(3))
            assert torch.equal(fused(ids).logits, prepacked(ids).logits)
    if model_type in ("llama", "qwen3"):  # Llama-style layers: every swap applies
        assert counts["mlp"] == counts["shared_input"] == 2 and counts["rms_norm"] >= 5, counts
    if model_type == "llama" and exact_ops.available():  # (Qwen3's attention normalizes q and k: its own code)
        assert counts["rotary"] == 2, counts
    if model_type == "gpt2":  # fused c_attn already, no q/k/v or Llama MLP: nothing to fuse
        assert counts["mlp"] == counts["shared_input"] == counts["rms_norm"] == counts["rotary"] == 0, counts


def test_a_member_called_with_another_input_computes_it_again():
    torch.manual_seed(0)
    linears = [nn.Linear(8, n) for n in (8, 4, 4)]
    group = SharedInputLinears(linears)
    members = [SharedInputMember(group, i) for i in range(3)]
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    with torch.inference_mode():
        q = members[0](a)
        k = members[1](b)  # a layer that projects another tensor: no stale slice of ``a``
        v = members[2](a)
        assert torch.allclose(q, linears[0](a), atol=1e-6)
        assert torch.allclose(k, linears[1](b), atol=1e-6)
        assert torch.allclose(v, linears[2](a), atol=1e-6)
    x = torch.randn(3, 8)
    q = members[0](x)
    x.add_(1.0)  # written in place between two members: recomputed
    assert torch.allclose(members[1](x), linears[1](x), atol=1e-6)


def counted_checks(monkeypatch) -> list[int]:
    """The width of every fusion check run from now on (each one still runs)."""
    from workers.cpu import cpu_fusion

    checked: list[int] = []
    real = cpu_fusion._same_outputs

    def counting(reference, candidate, width, like):
        checked.append(width)
        return real(reference, candidate, width, like)

    monkeypatch.setattr(cpu_fusion, "_same_outputs", counting)
    return checked


def test_each_shape_is_checked_once_and_a_failed_check_keeps_every_layer_of_that_shape_unfused(monkeypatch):
    """Kernels are picked by shape, dtype and CPU: the layers that share the first one's shapes take its
    verdict, both ways (a failed check leaves all of them as they were, and their logits unchanged)."""
    from workers.cpu import cpu_fusion

    path = build_arch_model("llama")
    checked = counted_checks(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts = fuse_cpu_layers(model)
    assert counts["mlp"] == counts["shared_input"] == 2 and counts["rms_norm"] >= 5, counts
    # The MLP, q/k/v and the RMSNorm width (5 norms) once each; the norm twice where the native kernel differs.
    assert len(checked) in (3, 4), checked

    monkeypatch.setattr(cpu_fusion, "_same_outputs", lambda reference, candidate, width, like: False)
    refused = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts = fuse_cpu_layers(refused)
    assert counts["mlp"] == counts["shared_input"] == counts["rms_norm"] == 0, counts
    with torch.inference_mode():
        prepack_linears(plain)
        ids = torch.randint(5, 500, (1, 9), generator=torch.Generator().manual_seed(3))
        assert torch.equal(refused(ids).logits, plain(ids).logits)


def test_a_fused_projections_verdict_is_kept_for_the_next_process_and_a_kept_no_is_honoured(monkeypatch, tmp_path):
    """Every worker process of every run would check the same shapes again: the MLP's and q/k/v's yes/no
    verdicts are kept in the store (per CPU, torch, threads and this code), and a kept "no" fuses nothing."""
    path = build_arch_model("llama")
    checked = counted_checks(monkeypatch)
    first = fuse_cpu_layers(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), store=tmp_path)
    assert first["mlp"] == first["shared_input"] == 2 and len(checked) in (3, 4), (first, checked)
    checks_first = len(checked)
    checked.clear()
    again = fuse_cpu_layers(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), store=tmp_path)
    assert again == first and len(checked) <= checks_first - 2  # the MLP's and q/k/v's verdicts were kept
    for kept in tmp_path.glob("*.json"):
        kept.write_text("false")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refused = fuse_cpu_layers(model, store=tmp_path)
    assert refused["mlp"] == 0  # (gate and up then share their input: a shape of its own, checked here)
    assert not [name for name, _ in model.named_modules() if name.endswith("q_proj_shared")]

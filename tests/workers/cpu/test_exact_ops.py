"""The native RMSNorm and rotary embedding equal transformers' eager ops bit for bit, or are not used."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from workers.cpu import exact_ops

pytestmark = pytest.mark.skipif(not exact_ops.available(), reason="no C++ compiler for the native ops")
EPS = 1e-5


def _eager_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps)
    norm.weight.data = weight
    return norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 100, 576, 2048, 4104])
def test_rms_norm_equals_transformers_bit_for_bit(dtype, width):
    generator = torch.Generator().manual_seed(width)
    weight = torch.randn(width, generator=generator).to(dtype)
    for rows in (1, 3, 64, 300):  # 300 x 4104 crosses the kernel's threading threshold
        x = (torch.randn(1, rows, width, generator=generator) * 5).to(dtype)
        assert torch.equal(exact_ops.rms_norm(x, weight, EPS), _eager_norm(x, weight, EPS))


def test_the_sum_order_check_tells_orders_apart():
    """A kernel adding in another order than torch's would be refused: float32 shows it."""
    lanes = exact_ops.sum_lanes(576, EPS)
    assert lanes in (4, 8, 16)
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 64, 576, generator=generator) * 3, torch.randn(576, generator=generator)
    want = _eager_norm(x, weight, EPS)
    for other in {4, 8, 16} - {lanes}:
        assert not torch.equal(exact_ops._rms_norm(x, weight, EPS, other), want)


def test_rms_norm_keeps_nan_and_inf_rows_to_themselves():
    weight = torch.ones(128, dtype=torch.bfloat16)
    x = torch.randn(1, 4, 128).to(torch.bfloat16)
    x[0, 1, 5], x[0, 2, 7] = float("nan"), float("inf")
    got, want = exact_ops.rms_norm(x, weight, EPS), _eager_norm(x, weight, EPS)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[0, [0, 3]], want[0, [0, 3]])


def test_inputs_the_kernel_does_not_take_are_left_to_the_caller():
    x = torch.randn(2, 64)
    assert exact_ops.rms_norm(x.half(), torch.ones(64, dtype=torch.half), EPS) is None
    assert exact_ops.rms_norm(x.bfloat16(), torch.ones(64), EPS) is None  # weight float32: the result would be too
    q = torch.randn(1, 2, 3, 8).bfloat16()
    assert exact_ops.rotary(q, q, torch.randn(1, 3, 8), torch.randn(1, 3, 8)) is None  # float32 cos: promotes
    assert exact_ops.rotary(q.expand(2, -1, -1, -1), q, torch.randn(1, 3, 8).bfloat16(),
                            torch.randn(1, 3, 8).bfloat16()) is None  # a batch of sequences


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 4), (32, 8, 2)])
def test_rotary_equals_transformers_bit_for_bit(dtype, head_dim, heads, kv_heads):
    assert exact_ops.rotary_exact(apply_rotary_pos_emb, heads, kv_heads, head_dim, dtype)
    generator = torch.Generator().manual_seed(head_dim)
    tokens = 300
    qkv = (torch.randn(1, tokens, (heads + 2 * kv_heads) * head_dim, generator=generator) * 8).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(1, tokens, heads, head_dim).transpose(1, 2)
    k = k.view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    angles = torch.arange(tokens).float()[:, None] * torch.rand(head_dim // 2, generator=generator)
    angles = torch.cat([angles, angles], dim=-1)[None]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got, want = exact_ops.rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def test_a_rotary_that_differs_is_refused():
    def shifted(q, k, cos, sin):  # the right formula but for one bfloat16 step on one element
        q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
        q_embed = q_embed.clone()
        q_embed[..., 0, 0] = q_embed[..., 0, 0].nextafter(torch.tensor(float("inf"), dtype=q_embed.dtype))
        return q_embed, k_embed

    assert not exact_ops.rotary_exact(shifted, 4, 2, 16, torch.bfloat16)

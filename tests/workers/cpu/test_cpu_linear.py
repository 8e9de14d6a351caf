"""Prepacked oneDNN linears compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.cpu.cpu_linear import PrepackedLinear, prepack_available, prepack_linears

pytestmark = pytest.mark.skipif(
    not prepack_available(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN linear ops"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_nn_linear(rows, bias, dtype):
    if not prepack_available(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN has no native {dtype} kernels on this CPU")
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias).to(dtype)
    packed = PrepackedLinear(linear)
    x = torch.randn(2, rows, 48, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the output
    with torch.inference_mode():
        out = packed(x)
        assert out.dtype == dtype
        assert torch.allclose(out.float(), linear(x).float(), atol=tol, rtol=tol)
        assert packed(x[:, ::2]).shape == (2, (rows + 1) // 2, 80)  # non-contiguous input


def test_prepack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        before = model(x)
        assert prepack_linears(model) == 2
        assert not any(type(m) is nn.Linear for m in model.modules())
        assert torch.allclose(model(x), before, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (576, 576), (64, 8192), (2048, 512)])
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_matmul(dtype, shape):
    """Seeded outputs alone == batched need it: oneDNN computes one row with another kernel (found on an
    AVX-512 CPU, K=1536: the last bits differ), so a single row is padded to two; every M must then give
    each row bit for bit what M=96 gives."""
    if not prepack_available(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN has no native {dtype} kernels on this CPU")
    torch.manual_seed(sum(shape))
    linear = nn.Linear(*shape, bias=False).to(dtype)
    packed = PrepackedLinear(linear)
    x = (torch.randn(96, shape[0]) * 3).to(dtype)
    with torch.inference_mode():
        full = packed(x)
        differ = [m for m in [*range(1, 34), 47, 64, 95] if not torch.equal(packed(x[:m]), full[:m])]
    assert differ == []

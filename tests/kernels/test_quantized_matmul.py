"""The W8A16 (int8_wo) and W4A16 (int4) kernels, one-row GEMV and batched GEMM, and the FP8 W8A8
GEMM against the torch path (de-quantize, then matmul; for fp8 of the per-token quantized
activations) within 1e-3 relative, in float32 under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.kernels.fp8_gemm import fp8_linear  # noqa: E402
from backend.kernels.int4_matmul import int4_gemm, int4_gemv  # noqa: E402
from backend.kernels.int8_matmul import int8_gemm, int8_gemv  # noqa: E402
from backend.quantization import Fp8Weight, Int4Weight, Int8Weight  # noqa: E402
from backend.quantization.fp8 import quantize_rows  # noqa: E402
from backend.quantization.int4_packing import quantize_groups  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpretable_triton_language")


def _relative_close(got: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-3) -> None:
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=rtol * scale)


def _int8(n: int, k: int, seed: int) -> Int8Weight:
    torch.manual_seed(seed)
    return Int8Weight.quantize(torch.randn(n, k)).to(DEVICE)


def _int4(n: int, k: int, group: int, seed: int, symmetric: bool = False) -> Int4Weight:
    torch.manual_seed(seed)
    q, z, scales = quantize_groups(torch.randn(n, k), group, symmetric)
    weight = Int4Weight(n, k, group)
    for name, value in Int4Weight.rows(q, z, scales).items():
        getattr(weight, name).copy_(value)
    return weight.to(DEVICE)


@pytest.mark.parametrize("n,k", [(40, 96), (16, 64)])
def test_int8_gemv_is_dequantize_then_matmul(n, k):
    """Rows and K columns that do not fill the last tile are masked (96 = 64 + 32)."""
    w = _int8(n, k, seed=n)
    x = torch.randn(1, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    dense = w.dequantize(torch.float32)
    _relative_close(int8_gemv(x, w.qweight, w.scales), F.linear(x, dense))
    _relative_close(int8_gemv(x, w.qweight, w.scales, bias, block_k=64), F.linear(x, dense, bias))
    _relative_close(w.matmul(x, bias), F.linear(x, dense, bias))  # the layer's torch path


@pytest.mark.parametrize("m,n,k", [(5, 40, 96), (33, 64, 64)])
def test_int8_gemm_is_dequantize_then_matmul(m, n, k):
    w = _int8(n, k, seed=m)
    x = torch.randn(m, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    expected = F.linear(x, w.dequantize(torch.float32), bias)
    _relative_close(int8_gemm(x, w.qweight, w.scales, bias), expected)
    _relative_close(int8_gemm(x, w.qweight, w.scales, bias, block_m=16, block_n=16), expected)


@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_gemv_is_dequantize_then_matmul(group, symmetric):
    n, k = 40, 256  # 40 rows: the last 16-row tile is masked
    w = _int4(n, k, group, seed=group, symmetric=symmetric)
    x = torch.randn(1, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    dense = w.dequantize(torch.float32)
    args = (w.qweight, w.scales, w.zeros, group)
    _relative_close(int4_gemv(x, *args), F.linear(x, dense))
    _relative_close(int4_gemv(x, *args, bias, block_k=32), F.linear(x, dense, bias))


@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("m", [3, 20])
def test_int4_gemm_is_dequantize_then_matmul(group, m):
    n, k = 48, 256
    w = _int4(n, k, group, seed=m)
    x = torch.randn(m, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    expected = F.linear(x, w.dequantize(torch.float32), bias)
    args = (w.qweight, w.scales, w.zeros, group, bias)
    _relative_close(int4_gemm(x, *args), expected)
    _relative_close(int4_gemm(x, *args, block_m=16, block_n=32, block_k=32), expected)


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 48, 256), (70, 24, 128)])
def test_fp8_gemm_is_the_torch_path(m, n, k):
    """Masked rows, columns and K (96 < one 128-wide K tile)."""
    torch.manual_seed(m)
    weight = Fp8Weight.quantize(torch.randn(n, k))
    x = torch.randn(m, k)
    x[0] *= 100  # per-token scales
    bias = torch.randn(n)
    expected = weight.matmul(x, bias)  # the CPU torch path
    weight, x, bias = weight.to(DEVICE), x.to(DEVICE), bias.to(DEVICE)
    xq, x_scales = quantize_rows(x)
    args = (xq, x_scales, weight.qweight, weight.scales, bias)
    _relative_close(fp8_linear(*args, out_dtype=x.dtype).cpu(), expected)
    small = fp8_linear(*args, out_dtype=x.dtype, block_m=16, block_n=16, block_k=32)
    _relative_close(small.cpu(), expected)

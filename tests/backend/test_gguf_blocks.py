"""GGUF blocks kept quantized: the torch decoders equal the gguf package's de-quantization bit for
bit (random blocks of every type, blocks the package quantizes, the default model's own tensors),
and a kept-quantized linear layer or embedding computes what its de-quantized weight does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize

from backend.gguf_blocks import BLOCK_TYPES, dequantize  # noqa: E402
from backend.layers import Embedding, Linear  # noqa: E402
from benchmarks.gguf_random import random_rows  # noqa: E402

PACKAGE_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")


def same_bits(ours: torch.Tensor, reference: np.ndarray) -> bool:
    return ours.dtype == torch.float32 and np.array_equal(
        ours.numpy().view(np.uint32), reference.astype(np.float32).view(np.uint32)
    )


def test_block_sizes_are_the_packages():
    for name, kind in BLOCK_TYPES.items():
        ggml = gguf.GGMLQuantizationType[name]
        assert (kind.ggml_type, kind.block_size, kind.type_size) == (
            ggml.value,
            *gguf.GGML_QUANT_SIZES[ggml],
        )


@pytest.mark.parametrize("quant_type", list(BLOCK_TYPES))
def test_random_blocks_decode_bit_for_bit(quant_type):
    raw = random_rows(quant_type, rows=9, blocks_per_row=3)
    ours = dequantize(torch.from_numpy(raw), quant_type)
    assert same_bits(ours, gguf_dequantize(raw, gguf.GGMLQuantizationType[quant_type]))


@pytest.mark.parametrize("quant_type", PACKAGE_QUANTIZES)
def test_blocks_the_package_quantizes_decode_bit_for_bit(quant_type):
    values = np.random.default_rng(1).standard_normal((16, 128)).astype(np.float32)
    raw = gguf_quantize(values, gguf.GGMLQuantizationType[quant_type])
    ours = dequantize(torch.from_numpy(raw), quant_type)
    reference = gguf_dequantize(raw, gguf.GGMLQuantizationType[quant_type])
    assert same_bits(ours, reference)
    assert np.abs(reference - values).max() < 0.5  # a real quantization of `values`


def test_the_default_models_tensors_decode_bit_for_bit():
    from backend.loading.model_paths import default_gguf_path

    reader = gguf.GGUFReader(default_gguf_path())
    seen = set()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name not in BLOCK_TYPES or (name in seen and not tensor.name.startswith("blk.29.")):
            continue  # every type once, and the last layer's
        seen.add(name)
        raw = np.asarray(tensor.data)
        ours = dequantize(torch.from_numpy(raw.copy()), name)
        assert same_bits(ours, gguf_dequantize(raw, tensor.tensor_type)), tensor.name
    assert seen == {"Q4_1", "Q8_0"}


def test_a_bad_row_is_refused_naming_the_rule():
    with pytest.raises(ValueError, match="Q4_1 rows must be uint8 of whole 20-byte blocks"):
        dequantize(torch.zeros(2, 30, dtype=torch.uint8), "Q4_1")
    with pytest.raises(ValueError, match="Q4_K rows hold whole blocks of 256 values, got 64"):
        Linear(64, 8).keep_quantized("Q4_K")


@pytest.mark.parametrize("quant_type", list(BLOCK_TYPES))
def test_a_quantized_linear_layer_is_dequantize_then_matmul(quant_type):
    kind = BLOCK_TYPES[quant_type]
    blocks_per_row, rows = 2, 24
    in_features = blocks_per_row * kind.block_size
    raw = torch.from_numpy(random_rows(quant_type, rows, blocks_per_row, seed=2))
    layer = Linear(in_features, rows, bias=True)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(rows))
    layer.keep_quantized(quant_type)
    layer.qweight.copy_(raw)
    assert layer.weight is None and layer.qweight.dtype == torch.uint8
    x = torch.randn(5, in_features)
    dense = torch.from_numpy(gguf_dequantize(raw.numpy(), gguf.GGMLQuantizationType[quant_type]))
    expected = F.linear(x, dense, layer.bias)
    got = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    assert torch.equal(got, expected)  # the same weight, bit for bit, so the same product


def test_a_quantized_embedding_and_its_tied_head():
    raw = torch.from_numpy(random_rows("Q8_0", rows=50, blocks_per_row=2, seed=3))
    embedding = Embedding(50, 64)
    embedding.keep_quantized("Q8_0", torch.float32)
    embedding.qweight.copy_(raw)
    dense = dequantize(raw, "Q8_0")
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(embedding(ids), F.embedding(ids, dense))
    head = Linear(64, 50)
    head.tie_to(embedding)
    assert head.qweight is embedding.qweight and head.quant_type == "Q8_0"
    hidden = torch.randn(2, 64)
    assert torch.equal(head(hidden), F.linear(hidden, dense))

"""Weights kept quantized in a linear layer: one concept, one class per format.

A `QuantizedWeight` stands in for a `Linear`'s [out_features, in_features] weight. It is a module
holding its tensors as buffers (so they move, materialise and count with the model), every
buffer with out_features as its first dimension (so a fused q|k|v or gate|up layer fills each
projection's rows as a dense weight does), and two methods:
    dequantize(dtype) -> [out_features, in_features] in dtype (the reference of what it holds)
    matmul(x, bias)   -> x @ W^T (+ bias): on CPU the torch path, on GPU the format's kernels
A format quantized at load has its quantizer (`quantize`); one read from checkpoints its layout
and checks (`checkpoint`, `check_checkpoint`, `for_checkpoint`, `checkpoint_buffers`).
`WEIGHT_CLASSES` maps each format of the table (backend/weight_formats.py, which says which
format is read, quantized at load, allowed for the lm_head) to its class:
- `gguf`     `GGUFWeight`: a GGUF file's blocks as stored (backend/gguf_blocks.py)
- `int8_wo`  `Int8Weight`: int8, one symmetric scale per output channel, quantized at load
- `int4_wo`  `Int4Weight`: 4-bit with a scale and zero point per group of input channels,
  rounded to nearest from float weights at load; `int4_awq` / `int4_gptq` (`AwqWeight`,
  `GptqWeight`): the same rows, from AWQ / GPTQ checkpoints
- `fp8`      `Fp8Weight`: float8 e4m3 with per-channel scales, activations quantized per token
  (W8A8), quantized at load or from an FP8 checkpoint
The lm_head and the embedding stay dense (quantized checkpoints leave them so too), except GGUF's
and an lm_head that `quantize_lm_head` quantizes
(`backend.loading.quantized_checkpoint.quantize_lm_head`).
"""

from backend.quantization.base import QuantizedWeight
from backend.quantization.fp8 import E4m3Rows, Fp8Weight
from backend.quantization.gguf import GGUFWeight
from backend.quantization.int4 import Int4Weight
from backend.quantization.int4_awq import AwqWeight
from backend.quantization.int4_gptq import GptqWeight
from backend.quantization.int8 import Int8Weight

WEIGHT_CLASSES: dict[str, type[QuantizedWeight]] = {
    cls.format: cls
    for cls in (GGUFWeight, Int8Weight, Int4Weight, AwqWeight, GptqWeight, Fp8Weight)
}

__all__ = [
    "WEIGHT_CLASSES",
    "AwqWeight",
    "E4m3Rows",
    "Fp8Weight",
    "GGUFWeight",
    "GptqWeight",
    "Int4Weight",
    "Int8Weight",
    "QuantizedWeight",
]

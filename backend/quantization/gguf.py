"""GGUF blocks kept as a GGUF file stores them (`backend.gguf_blocks`). One row on GPU runs the
GEMV over blocks (`backend.kernels.gguf_gemv`: every type here); other steps de-quantize, then
matmul."""

from __future__ import annotations

import torch

from backend.gguf_blocks import BLOCK_TYPES, dequantize
from backend.quantization.base import QuantizedWeight

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels import gguf_gemv
except ImportError:
    gguf_gemv = None


class GGUFWeight(QuantizedWeight):
    format = "gguf"

    def __init__(
        self,
        out_features: int,
        in_features: int,
        quant_type: str,
        qweight: torch.Tensor | None = None,
        device: torch.device | None = None,
    ):
        """`qweight`: uint8 [out_features, row bytes] of `quant_type` blocks (shared, e.g. a tied
        embedding's), else a new uninitialised one on `device`."""
        super().__init__(out_features, in_features)
        if qweight is None:
            row_bytes = BLOCK_TYPES[quant_type].row_bytes(in_features)
            qweight = torch.empty(out_features, row_bytes, dtype=torch.uint8, device=device)
        self.quant_type = quant_type
        self.register_buffer("qweight", qweight)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qweight, self.quant_type).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.quant_type}, " + super().extra_repr()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (
            x.is_cuda
            and gguf_gemv is not None
            and x.shape[0] == 1
            and self.quant_type in gguf_gemv.KERNEL_TYPES
        ):
            return gguf_gemv.gguf_gemv(x.contiguous(), self.qweight, self.quant_type, bias)
        return super().matmul(x, bias)

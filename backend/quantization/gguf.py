"""GGUF blocks kept as a GGUF file stores them (`backend.gguf_blocks`). On GPU one row runs
the GEMV over blocks (`backend.kernels.gguf_gemv`), a few rows the GEMM over blocks
(`backend.kernels.gguf_matmul`); longer steps (prefill) de-quantize in one kernel
(`backend.kernels.gguf_dequantize`), then matmul; CPU takes the torch decoders."""

from __future__ import annotations

import torch

from backend.gguf_blocks import BLOCK_TYPES, dequantize
from backend.kernels.tuning import compiles_for_gpu
from backend.quantization.base import QuantizedWeight

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels import gguf_dequantize, gguf_gemv, gguf_matmul
except ImportError:
    gguf_dequantize = gguf_gemv = gguf_matmul = None

# Longer steps de-quantize the weight once for cuBLAS: the GEMM de-quantizes every weight tile
# once per tile of rows, and lost to that at 64 rows (benchmarks/README.md, "GGUF weights kept
# quantized").
GEMM_MAX_ROWS = 32


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
        if self._on_gpu_kernels(self.qweight):
            return gguf_dequantize.gguf_dequantize(self.qweight, self.quant_type, dtype)
        return dequantize(self.qweight, self.quant_type).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.quant_type}, " + super().extra_repr()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if self._on_gpu_kernels(x) and rows == 1:
            return gguf_gemv.gguf_gemv(x.contiguous(), self.qweight, self.quant_type, bias)
        if self._on_gpu_kernels(x) and rows <= GEMM_MAX_ROWS:
            return gguf_matmul.gguf_gemm(x.contiguous(), self.qweight, self.quant_type, bias)
        return super().matmul(x, bias)

    @staticmethod
    def _on_gpu_kernels(t: torch.Tensor) -> bool:
        """Whether the kernels over blocks (every type of `backend.gguf_blocks`) take `t`'s
        device: a CUDA GPU they are compiled for."""
        return gguf_gemv is not None and compiles_for_gpu(t.device)

"""INT8 weight-only (`int8_wo`): int8 weights with one symmetric scale per output channel,
quantized at load from a float checkpoint; activations stay in the compute dtype (W8A16)."""

from __future__ import annotations

import torch

from backend.kernels.gemv_weight import StreamedWeight
from backend.quantization.base import QuantizedWeight

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels import w8a16_gemm
except ImportError:
    w8a16_gemm = None


class Int8Weight(QuantizedWeight):
    format = "int8_wo"

    def __init__(self, out_features: int, in_features: int, device: torch.device | None = None):
        super().__init__(out_features, in_features)
        shape = (out_features, in_features)
        self.register_buffer("qweight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, device=device))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        """Round to nearest with scale max|row| / 127 (the row's largest value is exactly kept)."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        quantized = cls(*w.shape, device=w.device)
        quantized.qweight.copy_(torch.round(w / scales[:, None]).clamp(-127, 127))
        quantized.scales.copy_(scales)
        return quantized

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def streamed(self) -> StreamedWeight:
        return StreamedWeight(self.qweight, self.scales)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda and w8a16_gemm is not None:
            one_row = self.streamed_matmul(x, bias)
            if one_row is not None:
                return one_row
            return w8a16_gemm.w8a16_gemm(x, self.qweight, self.scales, bias)
        return super().matmul(x, bias)

"""The interface every quantized weight implements (see backend/quantization/__init__.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.kernels.gemv_weight import StreamedWeight


class QuantizedWeight(nn.Module):
    """A [out_features, in_features] weight held quantized; its tensors are buffers whose first
    dimension is out_features."""

    format: str = ""  # the `quantization` value that makes it

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def streamed(self) -> StreamedWeight | None:
        """The weight as the one-token kernels stream it; None: a format they do not read."""
        return None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features] in x's dtype; the torch path: de-quantize into
        x's dtype, then matmul."""
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"{self.format}, out_features={self.out_features}, in_features={self.in_features}"

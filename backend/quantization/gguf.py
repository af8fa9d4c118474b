"""GGUF blocks kept as a GGUF file stores them (`backend.gguf_blocks`)."""

from __future__ import annotations

import torch

from backend.gguf_blocks import BLOCK_TYPES, dequantize
from backend.quantization.base import QuantizedWeight


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

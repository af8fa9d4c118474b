"""RMSNorm, optionally adding the residual first (the pre-norm block's add + norm).

On CUDA one Triton kernel (`backend.kernels.rmsnorm`), which can also quantize the normed rows
for an `fp8` projection's scaled GEMM (`e4m3`); elsewhere torch, in float32 and cast back as
transformers does. Gemma's (`unit_offset`) scales by (1 + weight) in float32 before the cast,
as transformers' Gemma norms do; it runs in torch.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.quantization import E4m3Rows

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels.rmsnorm import rms_norm as fused_rms_norm
except ImportError:
    fused_rms_norm = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, e4m3: bool = False):
        """x -> norm(x); with `residual`: (norm(x + residual), x + residual), the new residual.
        `e4m3`: norm(x) as `E4m3Rows` where the kernel runs (a tensor elsewhere)."""
        if x.is_cuda and fused_rms_norm is not None and not self.unit_offset:
            out = fused_rms_norm(x, self.weight, self.eps, residual, e4m3)
            normed = out if residual is None else out[0]
            if e4m3:
                normed = E4m3Rows(*normed, torch.promote_types(self.weight.dtype, x.dtype))
            return normed if residual is None else (normed, out[1])
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            out = (x32 * (1.0 + self.weight.float())).to(dtype)
        else:
            out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)

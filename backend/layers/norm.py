"""RMSNorm, optionally adding the residual first (the pre-norm block's add + norm).

On CUDA one Triton kernel (`backend.kernels.rmsnorm`); elsewhere torch, in float32 and cast back
as transformers does. Gemma's (`unit_offset`) scales by (1 + weight) in float32 before the cast,
as transformers' Gemma norms do; it runs in torch.
"""

from __future__ import annotations

import torch
from torch import nn

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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x -> norm(x); with `residual`: (norm(x + residual), x + residual), the new residual."""
        if x.is_cuda and fused_rms_norm is not None and not self.unit_offset:
            return fused_rms_norm(x, self.weight, self.eps, residual)
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

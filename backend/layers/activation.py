"""SwiGLU's activation: silu(gate) * up from the fused gate|up projection.

On CUDA one Triton kernel (`backend.kernels.activation`); elsewhere torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels.activation import silu_and_mul as fused_silu_and_mul
except ImportError:
    fused_silu_and_mul = None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate first) -> silu(gate) * up [T, I]."""
    if gate_up.is_cuda and fused_silu_and_mul is not None:
        return fused_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

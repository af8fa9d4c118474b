"""Gated activations of the fused gate|up projection: SwiGLU's silu(gate) * up, GeGLU's
gelu_tanh(gate) * up (Gemma).

SwiGLU on CUDA is one Triton kernel (`backend.kernels.activation`); the rest is torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels.activation import silu_and_mul as fused_silu_and_mul
    from backend.kernels.activation import silu_and_mul_e4m3
except ImportError:
    fused_silu_and_mul = silu_and_mul_e4m3 = None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate first) -> silu(gate) * up [T, I]."""
    if gate_up.is_cuda and fused_silu_and_mul is not None:
        return fused_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate first) -> gelu(gate, tanh approximation) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}

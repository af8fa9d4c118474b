"""SwiGLU's activation in one pass: out = silu(gate) * up, from the fused gate|up projection.

In torch this is two elementwise kernels and a temporary the size of the intermediate layer; one
program per (token, column tile) reads gate and up once and writes the product. silu is computed
in float32 and rounded once, like torch's bf16 silu followed by the multiply up to the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=mask, other=0.0)
    activated = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * stride_out + cols, activated * up, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate first) -> silu(gate) * up [T, I]."""
    num_tokens, double = gate_up.shape
    size = double // 2
    assert gate_up.stride(-1) == 1
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = 1024
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block, num_warps=4
        )
    return out

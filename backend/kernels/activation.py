"""SwiGLU's activation in one pass: out = silu(gate) * up, from the fused gate|up projection.

In torch this is two elementwise kernels and a temporary the size of the intermediate layer; one
program per (token, column tile) reads gate and up once and writes the product. silu is computed
in float32 and rounded once, like torch's bf16 silu followed by the multiply up to the last bit.
`silu_and_mul_e4m3` also quantizes each product row to e4m3 with its scale, for the scaled GEMM
of an `fp8` down projection: one pass instead of two and a bf16 temporary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.fp8_gemm import e4m3_row


@triton.jit
def silu_mul(gate, up):
    """silu(gate) rounded to up's dtype, times up (gate in float32): torch's bf16 silu, then the
    multiply. The float32 product of two 16-bit values is exact, so rounding it once is the
    16-bit multiply (which Triton's interpreter gets wrong for bfloat16)."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_mul(gate, up), mask=mask)


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


@triton.jit
def _silu_and_mul_e4m3_kernel(gate_up_ptr, q_ptr, scale_ptr, stride_in, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=mask, other=0.0)
    product = silu_mul(gate, up).to(tl.float32)
    q, scale = e4m3_row(product)
    tl.store(q_ptr + row * size + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_e4m3(
    gate_up: torch.Tensor, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [T, 2 * I] -> silu(gate) * up as e4m3 rows [T, I] and float32 scales [T, 1]: what
    `silu_and_mul` then `fp8_gemm.quantize_rows` give, bit for bit, in one pass (for the scaled
    e4m3 GEMM of an `fp8` down projection). One program a row, the whole row in registers."""
    num_tokens, double = gate_up.shape
    size = double // 2
    assert gate_up.stride(-1) == 1
    q = torch.empty((num_tokens, size), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty((num_tokens, 1), dtype=torch.float32, device=gate_up.device)
    if num_tokens:
        block = triton.next_power_of_2(size)
        _silu_and_mul_e4m3_kernel[(num_tokens,)](
            gate_up,
            q,
            scales,
            gate_up.stride(0),
            size,
            BLOCK=block,
            num_warps=num_warps or silu_row_warps(block),
        )
    return q, scales


def silu_row_warps(block: int) -> int:
    """Warps for a program over a row of `block` values: 32 values a thread, up to 32 warps
    (benchmarks/README.md, "Element-wise kernels")."""
    return min(32, max(4, block // 512))

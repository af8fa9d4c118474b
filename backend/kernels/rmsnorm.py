"""RMSNorm, optionally fused with the residual add that precedes it, in one pass over each row.

One program per token row (the row fits in registers: BLOCK = next power of two >= hidden):
    x = x + residual                     (rounded to the activation dtype; this is the new residual)
    out = weight * (x * rsqrt(mean(x^2) + eps))
The mean and the scaling run in float32; the normalised row is rounded to the activation dtype
before the weight multiply, the order of operations of `backend.layers.norm.RMSNorm` (and
transformers), so bf16/fp16 results agree with it up to rare last-bit differences from the order
of the float32 sum.

With `e4m3` the program writes `out` quantized for an `fp8` projection's scaled GEMM instead:
e4m3 values and the row's float32 scale, bit for bit what `fp8_gemm.quantize_rows` makes of the
rounded `out` (one pass instead of two, and no 16-bit temporary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.fp8_gemm import e4m3_row


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    scale_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    E4M3: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, 0) / hidden
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(OUT_DTYPE)
    if E4M3:  # out_ptr holds e4m3 values
        out, scale = e4m3_row(out.to(tl.float32))
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def norm_warps(block: int) -> int:
    """Warps for one program over a row of `block` (a power of two) values: up to 4, which
    the sweep found within 5% of the best at every row count (benchmarks/README.md,
    "Element-wise kernels")."""
    return min(4, max(1, block // 512))


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    e4m3: bool = False,
    num_warps: int | None = None,
):
    """x [T, hidden] -> out, or (out, x + residual) when `residual` is given. With `e4m3`, out is
    (e4m3 values [T, hidden], float32 scales [T, 1]), as `fp8_gemm.quantize_rows` of the rows.
    `num_warps` a program (one row): by default `norm_warps`."""
    num_rows, hidden = x.shape
    assert x.stride(-1) == 1 and weight.shape == (hidden,)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(
        (num_rows, hidden), dtype=torch.float8_e4m3fn if e4m3 else out_dtype, device=x.device
    )
    scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device) if e4m3 else None
    new_residual = torch.empty_like(x) if residual is not None else None
    if num_rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual if residual is not None else out,
            scales if e4m3 else weight,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            new_residual.stride(0) if residual is not None else 0,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            OUT_DTYPE=TL_DTYPES[out_dtype],
            E4M3=e4m3,
            num_warps=num_warps or norm_warps(block),
        )
    normed = (out, scales) if e4m3 else out
    return normed if residual is None else (normed, new_residual)

"""Linear layers over 4-bit weights with a scale and zero point per group of input channels
(W4A16, `backend.quantization.int4.Int4Weight`'s layout): out = x @ W^T with
W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g], de-quantized in registers.

`int4_gemm`, for steps of several rows: a program de-quantizes a [BLOCK_N, BLOCK_K / 2 bytes] tile
of weight rows into the activations' dtype (low nibbles: even input channels, high: odd) and
multiplies it on tensor cores with the even and the odd columns of BLOCK_M activation rows,
accumulating in float32. A K tile never straddles two groups (BLOCK_K divides the group size), so
each tile reads one scale and one zero point per row. One-row steps stream the weight through the
one-token GEMV (`backend.kernels.gemv`) instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.tuning import few_rows_tiles


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    x_rows = x_ptr + tl.where(m_ok, m, 0).to(tl.int64)[:, None] * stride_xm
    n_in = tl.where(n_ok, n, 0).to(tl.int64)
    groups = K // GROUP
    j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = tl.load(x_rows + (k0 + 2 * j)[None, :])  # [BLOCK_M, HALF]
        odd = tl.load(x_rows + (k0 + 2 * j + 1)[None, :])
        packed = tl.load(q_ptr + n_in[:, None] * (K // 2) + (k0 // 2 + j)[None, :])  # [N, HALF]
        packed = packed.to(tl.int32)
        s = tl.load(scale_ptr + n_in * groups + k0 // GROUP).to(tl.float32)[:, None]
        z = (tl.load(zero_ptr + n_in * groups + k0 // GROUP).to(tl.float32) + 8388608.0)[:, None]
        # No int-to-float conversion per weight: q | 0x4B000000 bitcast is exactly 2^23 + q.
        q_low = ((packed & 0x0F) | 0x4B000000).to(tl.float32, bitcast=True)
        q_high = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
        low = ((q_low - z) * s).to(even.dtype)
        high = ((q_high - z) * s).to(even.dtype)
        acc = tl.dot(even, tl.trans(low), acc)
        acc = tl.dot(odd, tl.trans(high), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_in).to(tl.float32)[None, :]
    out = out_ptr + m[:, None].to(tl.int64) * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x, qweight, scales, zeros, group_size, block_k) -> None:
    n, k = qweight.shape[0], qweight.shape[1] * 2
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous()
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1
    assert scales.shape == zeros.shape == (n, k // group_size)
    assert scales.is_contiguous() and zeros.is_contiguous() and zeros.dtype == torch.uint8
    assert group_size % block_k == 0, "a K tile must not straddle two groups"
    assert block_k >= 32, "each K tile's even and odd halves are dot operands of 16 or more"


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] -> x @ W^T (+ bias) [M, N] in x's dtype. Tiles: `few_rows_tiles` and K tiles of
    up to 128 within a group, unless given."""
    block_k = block_k or min(group_size, 128)
    _check(x, qweight, scales, zeros, group_size, block_k)
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    tiles = few_rows_tiles(m, n)
    block_m, block_n = block_m or tiles[0], block_n or tiles[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out

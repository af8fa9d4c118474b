"""Linear layers over 4-bit weights with a scale and zero point per group of input channels
(W4A16, `backend.quantization.int4.Int4Weight`'s layout): out = x @ W^T with
W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g], de-quantized in registers.

- `int4_gemv` (one row): one program owns BLOCK_N output rows and walks all of K, BLOCK_K / 2
  bytes of each row a step (the low nibbles multiply even input channels, the high ones odd);
  products accumulate elementwise in float32, summed over K once, at the end.
- `int4_gemm` (several rows): [BLOCK_K, BLOCK_N] weight tiles de-quantized into the activations'
  dtype and multiplied on tensor cores, accumulated in float32.
A K tile never straddles two groups (BLOCK_K divides the group size), so each tile reads one
scale and one zero point per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    groups = K // GROUP
    j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_N, HALF], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group = k0 // GROUP
        s = tl.load(scale_ptr + rows * groups + group).to(tl.float32)[:, None]
        z = tl.load(zero_ptr + rows * groups + group).to(tl.float32)[:, None]
        packed = tl.load(q_ptr + rows[:, None] * (K // 2) + (k0 // 2 + j)[None, :])
        x_even = tl.load(x_ptr + k0 + 2 * j).to(tl.float32)
        x_odd = tl.load(x_ptr + k0 + 2 * j + 1).to(tl.float32)
        low = ((packed & 0x0F).to(tl.float32) - z) * s
        high = ((packed >> 4).to(tl.float32) - z) * s
        acc += low * x_even[None, :] + high * x_odd[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


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
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    n_in = tl.where(n_ok, n, 0).to(tl.int64)
    groups = K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
            mask=m_ok[:, None],
            other=0.0,
        )
        packed = tl.load(q_ptr + n_in[None, :] * (K // 2) + (k // 2)[:, None])  # [K, N] tile
        q = (packed >> ((k % 2) * 4).to(tl.uint8)[:, None]) & 0x0F
        group = k0 // GROUP
        s = tl.load(scale_ptr + n_in * groups + group).to(tl.float32)
        z = tl.load(zero_ptr + n_in * groups + group).to(tl.float32)
        w = (q.to(tl.float32) - z[None, :]) * s[None, :]
        acc += tl.dot(a, w.to(a.dtype))
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


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 16,
    block_k: int | None = None,
) -> torch.Tensor:
    """x [1, K] -> x @ W^T (+ bias) [1, N] in x's dtype (W as the module docstring says)."""
    block_k = block_k or min(group_size, 128)
    _check(x, qweight, scales, zeros, group_size, block_k)
    assert x.shape[0] == 1
    n, k = qweight.shape[0], x.shape[1]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else scales,
        out,
        n,
        k,
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    block_m: int = 32,
    block_n: int = 64,
    block_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] -> x @ W^T (+ bias) [M, N] in x's dtype."""
    block_k = block_k or min(group_size, 64)
    _check(x, qweight, scales, zeros, group_size, block_k)
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
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

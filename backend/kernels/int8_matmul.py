"""Linear layers over int8 weights with one scale per output channel (W8A16) for steps of several
rows: out = x @ W^T, W = qweight * scales[:, None]. Tiles of [BLOCK_M, BLOCK_K] activations times
[BLOCK_K, BLOCK_N] weights cast to the activations' dtype (int8 values are exact in bf16/fp16) on
tensor cores; the per-channel scale multiplies the float32 sum once, after K. One-row steps stream
the weight through the one-token GEMV (`backend.kernels.gemv`) instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.tuning import few_rows_tiles


@triton.jit
def _int8_gemm_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(
            x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        q = tl.load(
            q_ptr + n[None, :].to(tl.int64) * K + k[:, None],
            mask=k_ok[:, None] & n_ok[None, :],
            other=0,
        )  # [BLOCK_K, BLOCK_N]: W^T's tile
        acc += tl.dot(a, q.to(a.dtype))
    acc *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None].to(tl.int64) * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    assert qweight.dtype == torch.int8 and qweight.is_contiguous()
    assert x.dim() == 2 and x.shape[1] == qweight.shape[1] and x.stride(1) == 1
    assert scales.dtype == torch.float32 and scales.shape == (qweight.shape[0],)


def int8_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int = 64,
) -> torch.Tensor:
    """x [M, K] -> x @ (qweight * scales[:, None])^T (+ bias) [M, N] in x's dtype. Tiles:
    `few_rows_tiles` unless given."""
    _check(x, qweight, scales)
    m, (n, k) = x.shape[0], qweight.shape
    tiles = few_rows_tiles(m, n)
    block_m, block_n = block_m or tiles[0], block_n or tiles[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _int8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        qweight,
        scales,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out

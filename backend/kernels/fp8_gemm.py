"""FP8 W8A8 linear layers for GPUs with float8 tensor cores (Hopper, sm_89+): out = x @ W^T with
x's rows quantized to e4m3 per token (dynamic scales) and W e4m3 with one scale per output
channel; e4m3 x e4m3 products accumulate in float32 (tl.dot), both scales applied once after K.

It computes what `backend.quantization.fp8.Fp8Weight`'s torch path computes on CPU; tests run it
under Triton's interpreter there (which widens the float8 operands), so its tiling and scaling
are checked, but not its speed or its code generation for Hopper.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def supported(device: torch.device) -> bool:
    """float8 tensor cores: compute capability 8.9 or newer."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    x_scale_ptr,
    q_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    m_in = tl.where(m_ok, m, 0).to(tl.int64)
    n_in = tl.where(n_ok, n, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_ptr + m_in[:, None] * K + k[None, :], mask=k_ok[None, :], other=0.0)
        b = tl.load(q_ptr + n_in[None, :] * K + k[:, None], mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
    acc *= tl.load(x_scale_ptr + m_in)[:, None] * tl.load(w_scale_ptr + n_in)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_in).to(tl.float32)[None, :]
    out = out_ptr + m[:, None].to(tl.int64) * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear(
    xq: torch.Tensor,
    x_scales: torch.Tensor,
    qweight: torch.Tensor,
    w_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 128,
) -> torch.Tensor:
    """Activations already quantized per row (xq e4m3 [M, K], x_scales float32 [M, 1]) ->
    x @ W^T (+ bias) [M, N] in out_dtype; qweight e4m3 [N, K], w_scales float32 [N]."""
    m, (n, k) = xq.shape[0], qweight.shape
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        xq.contiguous(),
        x_scales.contiguous(),
        qweight,
        w_scales,
        bias if bias is not None else w_scales,
        out,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out

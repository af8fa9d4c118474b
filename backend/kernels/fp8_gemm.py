"""FP8 W8A8 linear layers for GPUs with float8 tensor cores (sm_89+): out = x @ W^T with x's rows
quantized to e4m3 per token (dynamic scales) and W e4m3 with one scale per output channel; e4m3 x
e4m3 products accumulate in float32, both scales applied once after K.

- `quantize_rows`: each row's largest magnitude to e4m3's largest value, in one kernel.
- `fp8_linear`: the product. On Hopper and later with bfloat16 out, torch's row-wise scaled GEMM
  (`torch._scaled_mm`, CUTLASS); elsewhere the Triton kernel below (tl.dot of e4m3 tiles).
Both compute what `backend.quantization.fp8.Fp8Weight`'s torch path computes on CPU; tests run
the Triton kernels under the interpreter there (which widens the float8 operands), so their tiling
and scaling are checked on CPU, and their speed and code generation on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value


def supported(device: torch.device) -> bool:
    """float8 tensor cores: compute capability 8.9 or newer."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _takes_scaled_mm(xq: torch.Tensor, n: int, out_dtype: torch.dtype) -> bool:
    """torch's row-wise scaled GEMM: Hopper or later, bfloat16 out, K and N multiples of 16."""
    return (
        xq.is_cuda
        and torch.cuda.get_device_capability(xq.device) >= (9, 0)
        and out_dtype == torch.bfloat16
        and xq.shape[1] % 16 == 0
        and n % 16 == 0
    )


@triton.jit
def e4m3_row(x):
    """A whole row, float32 -> (its values over its scale, within e4m3's range; the scale:
    the row's largest magnitude / 448). The caller stores the values as e4m3."""
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
    return tl.clamp(x / scale, -FP8_MAX, FP8_MAX), scale


def row_warps(block: int) -> int:
    """Warps for one program over a whole row of `block` (a power of two) values."""
    return min(16, max(4, block // 1024))


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    q, scale = e4m3_row(x)
    tl.store(q_ptr + row * K + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]), x ~= values * scales, as
    `backend.quantization.fp8.quantize_rows` (one kernel instead of torch's five)."""
    m, k = x.shape
    assert x.stride(1) == 1
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block_k = triton.next_power_of_2(k)
    _quantize_rows_kernel[(m,)](
        x, xq, scales, k, x.stride(0), BLOCK_K=block_k, num_warps=row_warps(block_k)
    )
    return xq, scales


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
    if _takes_scaled_mm(xq, n, out_dtype):
        out = torch._scaled_mm(
            xq.contiguous(),
            qweight.t(),  # column-major [K, N], as the GEMM wants its second operand
            scale_a=x_scales.contiguous(),
            scale_b=w_scales.view(1, n),
            out_dtype=out_dtype,
        )
        return out if bias is None else out.add_(bias)
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

"""FP8 W8A8 linear layers for GPUs with float8 tensor cores (sm_89+): out = x @ W^T with x's rows
quantized to e4m3 per token (dynamic scales) and W e4m3 with one scale per output channel; e4m3 x
e4m3 products accumulate in float32, both scales applied once after K.

- `quantize_rows`: each row's largest magnitude to e4m3's largest value, in one kernel.
- `fp8_linear`: the product, by the Triton kernel below where the device's tuning table has a
  config for the shape (`tuning/fp8_gemm.json`, from `python -m benchmarks.quantized_matmul
  --sweep --write-tuning`), else on Hopper and later with bfloat16 out by torch's row-wise scaled
  GEMM (`torch._scaled_mm`, CUTLASS), else by the Triton kernel with its default config.

The kernel computes out^T = W x^T: a program's weight tile is the dot's first operand, so a step
of a few rows (decode) still fills the tensor cores' 64-row side with weights, and its rows are the
narrow side. A projection with few output tiles splits K over SPLIT programs, whose partial sums
the last of a tile's programs to arrive adds, scales and stores (`split_k`).

Both compute what `backend.quantization.fp8.Fp8Weight`'s torch path computes on CPU; tests run
the Triton kernels under the interpreter there (which widens the float8 operands), so their tiling
and scaling are checked on CPU, and their speed and code generation on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from backend.kernels.split_k import SwappedGemmConfig, add_split_partials, split_launch
from backend.kernels.tuning import device_name, lookup, rows_bucket, shape_key

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


Fp8GemmConfig = SwappedGemmConfig


@triton.jit
def _store_scaled(acc, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, m, n, M, N, HAS_BIAS):
    """acc [BLOCK_N, BLOCK_M], out^T's tile, times both scales plus the bias, into out [M, N]."""
    m_in = tl.where(m < M, m, 0).to(tl.int64)
    n_in = tl.where(n < N, n, 0).to(tl.int64)
    acc *= tl.load(w_scale_ptr + n_in)[:, None] * tl.load(x_scale_ptr + m_in)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_in).to(tl.float32)[:, None]
    out = out_ptr + m[None, :].to(tl.int64) * N + n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m < M)[None, :] & (n < N)[:, None])


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    x_scale_ptr,
    q_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    per_split,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    # Rows and columns past the edge read row 0 (never stored), so the loads need no mask.
    w_rows = q_ptr + tl.where(n < N, n, 0).to(tl.int64)[:, None] * K
    x_rows = x_ptr + tl.where(m < M, m, 0).to(tl.int64)[:, None] * K
    k_start = split * per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + per_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
            x = tl.load(x_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
        # Hopper's e4m3 tensor cores keep fewer bits than float32 in their running sum: each K
        # tile's sum is added into float32, so a long K loses no more than the output's rounding.
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
    if SPLIT == 1:
        _store_scaled(acc, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, m, n, M, N, HAS_BIAS)
    else:
        last, total = add_split_partials(acc, part_ptr, arrivals_ptr, m, n, M, N, SPLIT)
        if last:
            _store_scaled(total, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, m, n, M, N, HAS_BIAS)


def config_key(n: int, k: int, m: int) -> str:
    return shape_key(n=n, k=k, rows=rows_bucket(m))


def tuned_config(m: int, n: int, k: int, device: torch.device) -> Fp8GemmConfig | None:
    """The device's swept config for m rows times an [n, k] weight, or None."""
    return _tuned(device_name(device), n, k, rows_bucket(m))


@functools.lru_cache(maxsize=None)
def _tuned(device: str | None, n: int, k: int, rows: int) -> Fp8GemmConfig | None:
    entry = lookup("fp8_gemm", config_key(n, k, rows), device)
    return Fp8GemmConfig(**entry) if entry is not None else None


def fp8_linear(
    xq: torch.Tensor,
    x_scales: torch.Tensor,
    qweight: torch.Tensor,
    w_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig | None = None,
    out: torch.Tensor | None = None,
    fast_accumulation: bool = False,
) -> torch.Tensor:
    """Activations already quantized per row (xq e4m3 [M, K], x_scales float32 [M, 1]) ->
    x @ W^T (+ bias) [M, N] in out_dtype (written into `out`, contiguous, where given); qweight
    e4m3 [N, K], w_scales float32 [N]. Config: the given one, the device's tuned one, torch's
    scaled GEMM where it runs, else the default. `fast_accumulation`: torch's scaled GEMM sums
    in the tensor cores' accumulator without promoting to float32 (the Triton kernel promotes
    every K tile regardless)."""
    m, (n, k) = xq.shape[0], qweight.shape
    config = config or tuned_config(m, n, k, xq.device)
    if config is None and _takes_scaled_mm(xq, n, out_dtype):
        operands = dict(
            scale_a=x_scales.contiguous(),
            scale_b=w_scales.view(1, n),
            out_dtype=out_dtype,
            use_fast_accum=fast_accumulation,
        )
        # column-major [K, N] weight, as the GEMM wants its second operand
        if out is not None and bias is None:  # straight into `out`: no copy of the logits
            return torch._scaled_mm(xq.contiguous(), qweight.t(), **operands, out=out)
        product = torch._scaled_mm(xq.contiguous(), qweight.t(), **operands)
        product = product if bias is None else product.add_(bias)
        return product if out is None else out.copy_(product)
    c = config or Fp8GemmConfig(block_m=min(64, rows_bucket(m)))
    launch = split_launch("fp8_gemm", k, c.split, c.block_k, n, c.block_n, xq.device, m, c.block_m)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    assert out.dtype == out_dtype and out.shape == (m, n) and out.is_contiguous()
    _fp8_gemm_kernel[launch.grid](
        xq.contiguous(),
        x_scales.contiguous(),
        qweight,
        w_scales,
        bias if bias is not None else w_scales,
        out,
        *launch.buffers(out),
        m,
        n,
        k,
        launch.per_split,
        HAS_BIAS=bias is not None,
        EVEN_K=k % c.block_k == 0,
        **c.launch_args(launch.split),
    )
    return out

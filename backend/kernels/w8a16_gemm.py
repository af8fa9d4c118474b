"""Linear layers over one-byte weights (int8 or float8 e4m3) with one scale per output channel,
activations in 16 bits (W8A16), for steps of several rows: out = x @ W^T, W = qweight *
scales[:, None]. Tiles of [BLOCK_M, BLOCK_K] activations times [BLOCK_K, BLOCK_N] weights cast
to the activations' dtype (int8 values and e4m3 values are exact in bf16/fp16) on tensor cores;
the per-channel scale multiplies the float32 sum once, after K. One-row steps stream the weight
through the one-token GEMV (`backend.kernels.gemv`) instead.

A step of a few rows reads each weight once, so it is bound by the weight read when enough
programs stream at once: a projection with few output tiles splits K over SPLIT programs, which
write float32 partial sums that a second kernel adds, scales and casts (no atomics: the sum's
order is fixed). Launch configs per device and shape: `tuning/w8a16_gemm.json`, from
`python -m benchmarks.quantized_matmul --sweep --write-tuning`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend.kernels.tuning import device_name, lookup, rows_bucket, shape_key

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int = 64
    split: int = 1  # programs along K, their float32 partial sums added by a second kernel
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _w8a16_gemm_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        a = tl.load(
            x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        q = tl.load(
            q_ptr + n[None, :].to(tl.int64) * K + k[:, None],
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: W^T's tile
        acc += tl.dot(a, q.to(a.dtype))
    if PARTIAL:  # this split's sum, scaled and cast by _add_splits_kernel
        part = out_ptr + (tl.program_id(2) * M + m[:, None]).to(tl.int64) * N + n[None, :]
        tl.store(part, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        acc *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + m[:, None].to(tl.int64) * N + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _add_splits_kernel(
    part_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + (s * M + row) * N + n, mask=n_ok, other=0.0)
    acc *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def config_key(weight_dtype: torch.dtype, n: int, k: int, m: int) -> str:
    return shape_key(weight=str(weight_dtype).removeprefix("torch."), n=n, k=k, rows=rows_bucket(m))


def tuned_config(x: torch.Tensor, qweight: torch.Tensor) -> GemmConfig | None:
    """The device's swept config for this product, or None where the table has none."""
    (n, k), m = qweight.shape, x.shape[0]
    return _tuned(device_name(x.device), qweight.dtype, n, k, rows_bucket(m))


@functools.lru_cache(maxsize=None)
def _tuned(device: str | None, weight_dtype: torch.dtype, n: int, k: int, rows: int):
    entry = lookup("w8a16_gemm", config_key(weight_dtype, n, k, rows), device)
    return GemmConfig(**entry) if entry is not None else None


def default_config(m: int, n: int) -> GemmConfig:
    """Where the device's table has no entry: the shape most of the H100 sweep's winners took
    (benchmarks/README.md, "Weight formats"): 128-wide K tiles, three stages, and K split over
    four programs for the narrow projections, whose few output tiles would leave SMs idle."""
    if n <= 4096:
        return GemmConfig(min(64, rows_bucket(m)), 32, 128, split=4, num_stages=3)
    return GemmConfig(min(64, rows_bucket(m)), 64, 128, split=1, num_stages=3)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    assert qweight.dtype in WEIGHT_DTYPES and qweight.is_contiguous()
    assert x.dim() == 2 and x.shape[1] == qweight.shape[1] and x.stride(1) == 1
    assert scales.dtype == torch.float32 and scales.shape == (qweight.shape[0],)


def w8a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] -> x @ (qweight * scales[:, None])^T (+ bias) [M, N] in x's dtype. Config: the
    device's tuned one, else `default_config`."""
    _check(x, qweight, scales)
    m, (n, k) = x.shape[0], qweight.shape
    c = config or tuned_config(x, qweight) or default_config(m, n)
    k_per_split = triton.cdiv(triton.cdiv(k, c.split), c.block_k) * c.block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = split > 1
    target = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    has_bias = bias is not None
    _w8a16_gemm_kernel[(triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), split)](
        x,
        qweight,
        scales,
        bias if has_bias else scales,
        target,
        m,
        n,
        k,
        x.stride(0),
        k_per_split,
        HAS_BIAS=has_bias,
        PARTIAL=partial,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    if partial:
        block_n = min(1024, triton.next_power_of_2(n))
        _add_splits_kernel[(m, triton.cdiv(n, block_n))](
            target,
            scales,
            bias if has_bias else scales,
            out,
            m,
            n,
            SPLIT=split,
            HAS_BIAS=has_bias,
            BLOCK_N=block_n,
        )
    return out

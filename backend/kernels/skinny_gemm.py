"""Linear layers for steps of a few tokens (M <= 16): out = x @ weight^T, bound by weight reads.

At batch 1-16 a decode step's projections read their weights once and do almost no arithmetic.
cuBLAS streamed Llama-3.2-1B's qkv, o and down weights at 43-60% of the copy rate on H200, and
each projection came with a separate norm, activation or residual kernel. Here one program owns
BLOCK_N output features and walks the whole of K, so every weight row is read exactly once, there
is no split-K reduction. One token row multiplies elementwise (the products are summed over K once,
at the end); 2 to 16 rows ride along in one 16-row tensor-core dot.

Fusions, each saving a kernel launch and a round trip of the activations:
- prologue "norm": the operand is RMSNorm(x) * norm_weight. The norm is folded into the one pass
  over K: the rows' sums of squares accumulate beside the product of x * norm_weight, and the
  result is scaled by rsqrt(mean square + eps) at the end. (A statistics pass before the weights
  stream would stall every program; the rounding differs from RMSNorm-then-GEMM by activation-dtype
  ulps, fewer roundings rather than more.)
- prologue "silu_mul": x is [M, 2K] = gate | up and the operand is silu(gate) * up, rounded as
  `backend.kernels.activation.silu_and_mul` rounds.
- epilogue residual: out = round(x @ weight^T + bias) + residual, rounded once more, as torch's
  add of the two rounded tensors. `out` may be `residual` itself (each program reads and writes
  only its own columns).
The float32 sums run in a different order than cuBLAS's, so results agree with the torch path up
to the last bits of the activation dtype, not exactly.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from backend.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options

MAX_TOKENS = 16
# Triton's CPU interpreter multiplies bf16 tiles wrongly in tl.dot; there the operands are widened
# to float32 first (exact: the products of bf16 values are what the tensor cores accumulate too).
_WIDEN_DOT = os.environ.get("TRITON_INTERPRET") == "1"
NO_PROLOGUE, NORM, SILU_MUL = 0, 1, 2


@triton.jit
def _operand_tile(x_ptr, norm_w_ptr, rows, row_ok, k, stride_xm, K, PROLOGUE: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_K] operand tile at columns `k` after the prologue, and the
    tile's sum of squares per row (for the norm; zeros otherwise)."""
    dtype = x_ptr.dtype.element_ty
    offsets = rows[:, None] * stride_xm + k[None, :]
    x = tl.load(x_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    square_sum = tl.zeros([x.shape[0]], tl.float32)
    if PROLOGUE == 1:
        square_sum = tl.sum(x * x, 1)
        x = x * tl.load(norm_w_ptr + k).to(tl.float32)[None, :]
    if PROLOGUE == 2:
        up = tl.load(x_ptr + offsets + K, mask=row_ok[:, None], other=0.0).to(tl.float32)
        activated = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
        x = (activated * up).to(dtype).to(tl.float32)
    return x, square_sum


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, norm_w_ptr, residual_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WIDEN_DOT: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    if PDL:
        gdc_wait()
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols_in = tl.where(col_ok, cols, 0).to(tl.int64)          # masked columns read row 0
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols_in[:, None] * stride_wn
    square_sum = tl.zeros([BLOCK_M], tl.float32)

    if USE_DOT:        # 16 token rows: one tensor-core dot per weight tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            a, tile_squares = _operand_tile(x_ptr, norm_w_ptr, rows, row_ok, k, stride_xm, K, PROLOGUE)
            square_sum += tile_squares
            w = tl.load(w_rows + k[None, :])
            if WIDEN_DOT:
                acc += tl.dot(a.to(dtype).to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                acc += tl.dot(a.to(dtype), tl.trans(w))
    else:              # one token: elementwise products, summed over K once at the end
        partial = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            a, tile_squares = _operand_tile(x_ptr, norm_w_ptr, rows, row_ok, k, stride_xm, K, PROLOGUE)
            square_sum += tile_squares
            w = tl.load(w_rows + k[None, :])
            partial += w.to(tl.float32) * a
        acc = tl.sum(partial, 1)[None, :]
    if PDL:
        gdc_launch_dependents()
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(square_sum / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask)
        y = (y.to(tl.float32) + residual.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y, mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` takes this product: few rows, half precision, K in 64-wide tiles."""
    return (x.shape[0] <= MAX_TOKENS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.shape[1] % 64 == 0)


def launch_config(num_tokens: int, n: int, k: int) -> dict:
    """Tile and launch shape, from `python -m benchmarks.skinny_gemm --sweep` on H200 (Llama-3.2-1B
    shapes, products timed back to back in a CUDA graph): for one token, narrow column tiles
    (4 features) on the 2048-3072-wide projections so 500-800 programs stream the weights, 16 on
    the wide ones; for 2-16 tokens, 32- or 64-wide tiles for the dot."""
    def widest_k(*choices):
        return next((b for b in choices if k % b == 0), 64)
    if num_tokens <= 1:
        if n <= 4096:
            return dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=widest_k(512, 256, 128), num_warps=8, num_stages=4)
        return dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=widest_k(256, 128), num_warps=8, num_stages=2)
    if n <= 4096:
        return dict(BLOCK_M=MAX_TOKENS, BLOCK_N=32, BLOCK_K=widest_k(256, 128), num_warps=4, num_stages=4)
    return dict(BLOCK_M=MAX_TOKENS, BLOCK_N=64, BLOCK_K=widest_k(128), num_warps=4, num_stages=4)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                  silu_mul: bool = False, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with `silu_mul`), weight [N, K] -> [M, N] for M <= 16.

    `norm_weight`/`eps`: RMSNorm x first. `silu_mul`: x is gate | up, use silu(gate) * up.
    `residual` [M, N]: add it to the result (`out=residual` updates it in place).
    """
    num_tokens = x.shape[0]
    n, k = weight.shape
    assert num_tokens <= MAX_TOKENS and not (silu_mul and norm_weight is not None)
    assert x.shape[1] == (2 * k if silu_mul else k), (tuple(x.shape), tuple(weight.shape))
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    if out is None:
        out = torch.empty((num_tokens, n), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    config = {**launch_config(num_tokens, n, k), **(config or {})}
    assert k % config["BLOCK_K"] == 0, "K must be a multiple of BLOCK_K"
    assert num_tokens <= config["BLOCK_M"] and config["BLOCK_M"] in (1, MAX_TOKENS)
    prologue = SILU_MUL if silu_mul else NORM if norm_weight is not None else NO_PROLOGUE
    _skinny_gemm_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight,
        norm_weight if norm_weight is not None else weight,
        residual if residual is not None else out, out,
        num_tokens, n, k, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        WIDEN_DOT=_WIDEN_DOT, USE_DOT=config["BLOCK_M"] == MAX_TOKENS, **config, **launch_options(),
    )
    return out

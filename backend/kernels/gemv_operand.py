"""The one-token GEMV's operand (`backend.kernels.gemv`): columns of x after the kernel's prologue
(RMSNorm, silu·mul, or split attention partials merged as they are read), in float32."""

from __future__ import annotations

import triton
import triton.language as tl

from backend.kernels.split_merge import merge_splits


@triton.jit
def operand_tile(x_ptr, norm_w_ptr, k, K, PROLOGUE: tl.constexpr):
    """The float32 operand at columns `k` (of any shape) after the prologue, and its sum of
    squares (norm)."""
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + k).to(tl.float32)
    square_sum = 0.0
    if PROLOGUE == 1:
        square_sum = tl.sum(x * x)
        x = x * tl.load(norm_w_ptr + k).to(tl.float32)
    if PROLOGUE == 2:
        up = tl.load(x_ptr + K + k).to(tl.float32)
        activated = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
        x = (activated * up).to(dtype).to(tl.float32)
    return x, square_sum


@triton.jit
def operand_at(
    x_ptr,
    norm_w_ptr,
    k0,
    cols,
    K,
    PROLOGUE: tl.constexpr,
    WIDTH: tl.constexpr,
    num_splits,
    parts_head,
    parts_split,
    lse_head,
    lse_split,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
):
    """The float32 operand at columns `cols` (k0..k0 + WIDTH, in any shape) and its sum of
    squares: split partials merged where PROLOGUE is 3 (`merged_operand`'s arguments), else
    `operand_tile`'s."""
    if PROLOGUE == 3:
        merged = merged_operand(
            x_ptr,
            norm_w_ptr,
            k0,
            num_splits,
            parts_head,
            parts_split,
            lse_head,
            lse_split,
            WIDTH,
            SPLITS_PAD,
            HEAD_DIM,
            ACT_DTYPE,
        )
        return tl.reshape(merged, cols.shape), 0.0
    else:
        return operand_tile(x_ptr, norm_w_ptr, cols, K, PROLOGUE)


@triton.jit
def merged_operand(
    parts_ptr,
    lse_ptr,
    k0,
    num_splits,
    parts_head,
    parts_split,
    lse_head,
    lse_split,
    WIDTH: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    dtype: tl.constexpr,
):
    """The float32 operand at columns k0..k0+WIDTH (whole heads) merged from the split partials
    parts [heads, num_splits, HEAD_DIM] and lse [heads, num_splits] (at their head and split
    strides), rounded to `dtype`."""
    HEADS: tl.constexpr = WIDTH // HEAD_DIM
    heads = k0 // HEAD_DIM + tl.arange(0, HEADS)
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(
        lse_ptr + heads[:, None] * lse_head + splits[None, :] * lse_split,
        mask=splits[None, :] < num_splits,
        other=float("-inf"),
    )  # [H, S]
    part = heads[:, None] * parts_head + splits[None, :] * parts_split  # [H, S]
    parts = tl.load(
        parts_ptr + part[:, :, None] + tl.arange(0, HEAD_DIM)[None, None, :],
        mask=(lse > float("-inf"))[:, :, None],  # splits of no weight are not read
        other=0.0,
    )  # [H, S, D]
    merged = merge_splits(parts, lse)
    return tl.reshape(merged.to(dtype).to(tl.float32), (WIDTH,))

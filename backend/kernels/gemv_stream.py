"""The weight-streaming dot of the one-token kernels: BLOCK_N weight rows dotted with one operand
row over all of K, in float32. `backend.kernels.gemv` and `backend.kernels.qkv_rope` build on it.

Each program reads its first PREFETCH_K weight columns before it waits for the previous kernel
(programmatic dependent launch, `backend.kernels.pdl`): weights are never written by a kernel, so
they stream while the predecessor drains. The operand is produced as it is read
(`backend.kernels.gemv_operand`: the norm, silu·mul or split-merge prologues); 4-bit rows have a
dot of their own (`backend.kernels.gemv_int4`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backend.kernels.gemv_int4 import stream_rows_dot_int4
from backend.kernels.gemv_operand import operand_at
from backend.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def stream_rows_dot(
    x_ptr,
    w_ptr,
    norm_w_ptr,
    rows,
    K,
    stride_wn,
    eps,
    PROLOGUE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr,
    SKIP_WAIT: tl.constexpr = False,
    num_splits=1,
    SPLITS_PAD: tl.constexpr = 1,
    HEAD_DIM: tl.constexpr = 1,
    parts_head=0,
    parts_split=0,
    lse_head=0,
    lse_split=0,
    ACT_DTYPE: tl.constexpr = tl.float16,
    WEIGHT: tl.constexpr = 0,
    scale_ptr=0,
    GROUP: tl.constexpr = 1,
    K_LOOP: tl.constexpr = True,
    exponent_bits=0,
    k_start=0,
    k_end=0,
    F16X2: tl.constexpr = False,
):
    """float32 [BLOCK_N]: weight rows `rows` (int64) dotted with the operand over all of K, the
    norm's scale applied. Waits for the previous kernel (PDL) after reading the first PREFETCH_K
    weight columns, and lets the next one launch early (EARLY_LAUNCH) or after the loop.
    SKIP_WAIT is a diagnostic: no wait, so the operand may be stale and the result wrong; only
    `benchmarks.gemv --chain --wait-cost` sets it, to time what the waits cost. With the merge
    prologue, x_ptr / norm_w_ptr are the split partials / their lse (`num_splits` of them, heads
    of HEAD_DIM, at the strides parts_head / parts_split / lse_head / lse_split), merged and
    rounded to ACT_DTYPE (the activations' dtype).
    WEIGHT (`StreamedWeight.kind`): DENSE values; ROW_SCALED int8 or e4m3 values times a float32
    scale per row (scale_ptr); INT4 packed 4-bit rows with a scale and zero point per GROUP
    inputs in one word (scale_ptr; `backend.kernels.gemv_int4`: exponent_bits is its
    `EXPONENT_2_23`; it sums inputs k_start..k_end, 0..K unless K is split; F16X2 unpacks them
    in half-precision pairs).
    K_LOOP is False where PREFETCH_K covers K: with no loop in the kernel, the prefetched tile
    keeps the layout it was loaded in (a loop's tiles take another, and the compiler would move
    the prefetched weights through shared memory to match them)."""
    if WEIGHT == 2:  # a static branch: 4-bit rows stream on their own
        return stream_rows_dot_int4(
            x_ptr,
            w_ptr,
            norm_w_ptr,
            scale_ptr,
            rows,
            K,
            eps,
            PROLOGUE,
            PDL,
            BLOCK_N,
            BLOCK_K,
            EARLY_LAUNCH,
            GROUP,
            SKIP_WAIT,
            exponent_bits,
            k_start,
            k_end,
            num_splits,
            SPLITS_PAD,
            HEAD_DIM,
            parts_head,
            parts_split,
            lse_head,
            lse_split,
            ACT_DTYPE,
            F16X2,
        )
    w_rows = w_ptr + rows[:, None] * stride_wn
    if PDL and EARLY_LAUNCH:
        gdc_launch_dependents()
    if PREFETCH_K > 0:  # the weights are never written by a kernel: read them before waiting
        w_first = tl.load(w_rows + tl.arange(0, PREFETCH_K)[None, :])
    if PDL and not SKIP_WAIT:
        gdc_wait()
    square_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    if PREFETCH_K > 0:
        a_first, first_squares = operand_at(
            x_ptr,
            norm_w_ptr,
            0,
            tl.arange(0, PREFETCH_K),
            K,
            PROLOGUE,
            PREFETCH_K,
            num_splits,
            parts_head,
            parts_split,
            lse_head,
            lse_split,
            SPLITS_PAD,
            HEAD_DIM,
            ACT_DTYPE,
        )
        square_sum += first_squares
        acc += tl.sum(w_first.to(tl.float32) * a_first[None, :], 1)
    if K_LOOP:  # a static branch: K goes past the prefetched columns
        ks = tl.arange(0, BLOCK_K)
        partial = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(PREFETCH_K, K, BLOCK_K):
            k = k0 + ks
            a, tile_squares = operand_at(
                x_ptr,
                norm_w_ptr,
                k0,
                k,
                K,
                PROLOGUE,
                BLOCK_K,
                num_splits,
                parts_head,
                parts_split,
                lse_head,
                lse_split,
                SPLITS_PAD,
                HEAD_DIM,
                ACT_DTYPE,
            )
            square_sum += tile_squares
            w = tl.load(w_rows + k[None, :])
            partial += w.to(tl.float32) * a[None, :]
        acc += tl.sum(partial, 1)
    if PDL and not EARLY_LAUNCH:
        gdc_launch_dependents()
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(square_sum / K + eps)
    if WEIGHT == 1:
        acc = acc * tl.load(scale_ptr + rows)
    return acc

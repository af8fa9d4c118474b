"""The one-token GEMV's weight stream for 4-bit rows (W4A16, `backend.quantization.int4`'s layout:
packed bytes [N, K / 2], the low nibble an even input channel, the high one the next; a scale and
a zero point per row and group of GROUP inputs), de-quantized in registers.

The bytes are read as int32 words: nibble p of word w (bits 4p..4p+3, little-endian) is input
8w + p, so a tile of words unpacks with eight shifts into [rows, words, 8] values in input order
and meets the operand's contiguous columns. Each word reads its group's scale and zero point
(cached gathers), so a K tile may span several groups. Nothing is read before the PDL wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backend.kernels.gemv_operand import operand_tile
from backend.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def stream_rows_dot_int4(
    x_ptr,
    words_ptr,
    norm_w_ptr,
    scale_ptr,
    zero_ptr,
    rows,
    K,
    eps,
    PROLOGUE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr,
    GROUP: tl.constexpr,
    SKIP_WAIT: tl.constexpr = False,
):
    """float32 [BLOCK_N]: the 4-bit rows `rows` (int64; words_ptr: the packed bytes as int32)
    dotted with the operand over all of K, the norm's scale applied (as
    `backend.kernels.gemv.stream_rows_dot`)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    word_rows = words_ptr + rows[:, None] * (K // 8)
    group_rows = rows[:, None] * (K // GROUP)
    w = tl.arange(0, WORDS)
    nibble = tl.arange(0, 8)
    shifts = (nibble * 4)[None, None, :]
    if PDL and EARLY_LAUNCH:
        gdc_launch_dependents()
    if PDL and not SKIP_WAIT:
        gdc_wait()
    square_sum = tl.zeros([1], tl.float32)
    partial = tl.zeros([BLOCK_N, WORDS, 8], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, tile_squares = operand_tile(
            x_ptr, norm_w_ptr, k0 + w[:, None] * 8 + nibble[None, :], K, PROLOGUE
        )  # [WORDS, 8]
        square_sum += tile_squares
        words = tl.load(word_rows + (k0 // 8 + w)[None, :])  # [BLOCK_N, WORDS]
        group = group_rows + (k0 + 8 * w)[None, :] // GROUP
        scale = tl.load(scale_ptr + group).to(tl.float32)[:, :, None]
        # No int-to-float conversion per weight: q | 0x4B000000 bitcast is exactly 2^23 + q.
        zero = (tl.load(zero_ptr + group).to(tl.float32) + 8388608.0)[:, :, None]
        q = (((words[:, :, None] >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        partial += (q - zero) * scale * a[None, :, :]
    if PDL and not EARLY_LAUNCH:
        gdc_launch_dependents()
    acc = tl.sum(tl.sum(partial, 2), 1)
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(square_sum / K + eps)
    return acc

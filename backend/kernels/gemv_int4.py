"""The one-token GEMV's weight stream for 4-bit rows (W4A16, `backend.quantization.int4`'s layout:
packed bytes [N, K / 2], the low nibble an even input channel, the high one the next; a scale and
a zero point per row and group of GROUP inputs), de-quantized in registers.

The bytes are read as int32 words: nibble p of word w (bits 4p..4p+3, little-endian) is input
8w + p. Each thread keeps whole words and unpacks them where they lie: nibble p (p < 4; the high
half-word is shifted down once for nibbles 4-7), masked and ORed with the exponent bits of
2^(23 - 4p), is exactly the float32 2^(23 - 4p) + q, so one subtraction of 2^(23 - 4p) + z
leaves q - z. The exponent bits come in as an argument (`exponent_bits`, 2^23's) so that the
compiler keeps them in a register and the mask and OR are one instruction. The eight planes are
joined back into input order in registers. Each group's products are summed before its scale
multiplies them, so a weight costs a mask, a subtract and a multiply-add. Tiles are [groups,
rows, words]: with groups leading, a warp's threads spread over a row's groups before its rows,
so each thread's operand columns serve more rows. The first K tile is read before the PDL wait,
each next one while the current one is summed. A program may sum only part of K (the GEMV's K
split).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backend.kernels.gemv_operand import operand_at
from backend.kernels.gemv_weight import EXPONENT_2_23
from backend.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _plane(half_words, p: tl.constexpr, exponent_bits, zero):
    """q - z for nibble p (0..3) of each half-word, in float32."""
    bits = (half_words & (0xF << (4 * p))) | (exponent_bits - ((4 * p) << 23))
    return bits.to(tl.float32, bitcast=True) - (zero + 2.0 ** (23 - 4 * p))


@triton.jit
def _tile(word_rows, group_rows, scale_ptr, zero_ptr, k0, k_end, words_in_tile, GROUP, GROUPS):
    """The words [GROUPS, BLOCK_N, WORDS], scales [GROUPS, BLOCK_N] and zero points of the K tile
    at k0 (none past k_end). Groups lead: threads spread over a row's groups before its rows."""
    word = k0 // 8 + words_in_tile
    words = tl.load(word_rows + word[:, None, :], mask=(word < k_end // 8)[:, None, :], other=0)
    groups = k0 // GROUP + tl.arange(0, GROUPS)[:, None]
    in_k = groups < k_end // GROUP
    scale = tl.load(scale_ptr + group_rows + groups, mask=in_k, other=0).to(tl.float32)
    zero = tl.load(zero_ptr + group_rows + groups, mask=in_k, other=0).to(tl.float32)
    return words, scale, zero


@triton.jit
def _tile_dot(words, scale, zero, a, exponent_bits, BLOCK_N, GROUPS, WORDS):
    """[GROUPS, BLOCK_N]: each group's and row's q - z dotted with the operand a [GROUPS, WORDS,
    8], times the group's scale."""
    zero = zero[:, :, None]
    high = words >> 16
    # Joined as [.., 2 (bit 2 of p), 2 (bit 1), 2 (bit 0)]: index 4a + 2b + c is nibble p.
    q = tl.join(
        tl.join(
            tl.join(_plane(words, 0, exponent_bits, zero), _plane(high, 0, exponent_bits, zero)),
            tl.join(_plane(words, 2, exponent_bits, zero), _plane(high, 2, exponent_bits, zero)),
        ),
        tl.join(
            tl.join(_plane(words, 1, exponent_bits, zero), _plane(high, 1, exponent_bits, zero)),
            tl.join(_plane(words, 3, exponent_bits, zero), _plane(high, 3, exponent_bits, zero)),
        ),
    )
    q = tl.reshape(q, [GROUPS, BLOCK_N, WORDS, 8])
    return tl.sum(tl.sum(q * a[:, None, :, :], 3), 2) * scale


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
    exponent_bits=EXPONENT_2_23,
    k_start=0,
    k_end=0,
    num_splits=1,
    SPLITS_PAD: tl.constexpr = 1,
    HEAD_DIM: tl.constexpr = 1,
    parts_head=0,
    parts_split=0,
    lse_head=0,
    lse_split=0,
    ACT_DTYPE: tl.constexpr = tl.float16,
):
    """float32 [BLOCK_N]: the 4-bit rows `rows` (int64; words_ptr: the packed bytes as int32)
    dotted with the operand over inputs k_start..k_end (whole K tiles; all of K with the norm,
    whose scale is applied, as `backend.kernels.gemv.stream_rows_dot`). BLOCK_K is a multiple of
    GROUP. With the merge prologue (3) the operand is split attention's partials, merged as they
    are read (`backend.kernels.gemv_operand.merged_operand`). The first K tile is read before the
    PDL wait (weights are never written by a kernel), and each next one while the current one is
    summed."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP  # groups per K tile
    WORDS: tl.constexpr = GROUP // 8  # words per group
    words_in_tile = tl.arange(0, GROUPS)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    word_rows = words_ptr + rows[None, :, None] * (K // 8)
    group_rows = rows[None, :] * (K // GROUP)
    inputs = 8 * words_in_tile[:, :, None] + tl.arange(0, 8)[None, None, :]  # [GROUPS, WORDS, 8]
    if PDL and EARLY_LAUNCH:
        gdc_launch_dependents()
    words, scale, zero = _tile(
        word_rows, group_rows, scale_ptr, zero_ptr, k_start, k_end, words_in_tile, GROUP, GROUPS
    )
    if PDL and not SKIP_WAIT:
        gdc_wait()
    square_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([GROUPS, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a, tile_squares = operand_at(
            x_ptr,
            norm_w_ptr,
            k0,
            k0 + inputs,
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
        next_words, next_scale, next_zero = _tile(
            word_rows,
            group_rows,
            scale_ptr,
            zero_ptr,
            k0 + BLOCK_K,
            k_end,
            words_in_tile,
            GROUP,
            GROUPS,
        )
        acc += _tile_dot(words, scale, zero, a, exponent_bits, BLOCK_N, GROUPS, WORDS)
        words, scale, zero = next_words, next_scale, next_zero
    if PDL and not EARLY_LAUNCH:
        gdc_launch_dependents()
    acc = tl.sum(acc, 0)
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(square_sum / K + eps)
    return acc

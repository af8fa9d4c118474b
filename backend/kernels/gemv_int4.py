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

Compiled for a CUDA GPU (F16X2), a word is unpacked in half-precision pairs by inline PTX instead,
each instruction working on two weights: nibbles 0 and 4 masked under float16 1024's exponent bits
read as 1024 + q, nibbles 1 and 5 (bits 4..7 of each half-word) under 64's as 64 + q, and the word
shifted by 8 gives nibbles 2, 6 and 3, 7 the same way; one paired subtraction leaves q - z, and the
eight products are summed as pairs of halves against the operand packed in the same pairs. Each
word's eight operand columns are scaled by a power of two that brings their largest magnitude into
[128, 256), so the word's sum (at most 8 * 15 * 256) stays within float16's range, and the sum
takes the inverse power back with the group's scale. The per-word sums accumulate over K in
float32 and are summed over words once, at the end. The interpreter runs no PTX and keeps the
float32 path.
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
def _tile(word_rows, group_rows, scale_zero_ptr, k0, k_end, words_in_tile, GROUP, GROUPS):
    """The words [GROUPS, BLOCK_N, WORDS], scales [GROUPS, BLOCK_N] and zero points of the K tile
    at k0 (none past k_end), the last two from one word a group (`Int4Weight.scale_zero`).
    Groups lead: threads spread over a row's groups before its rows."""
    word = tl.multiple_of(k0 // 8, 8) + words_in_tile  # k0: a multiple of the K tile
    words = tl.load(
        word_rows + word[:, None, :],
        mask=(word < tl.multiple_of(k_end // 8, 8))[:, None, :],
        other=0,
    )
    groups = k0 // GROUP + tl.arange(0, GROUPS)[:, None]
    in_k = groups < k_end // GROUP
    scale_zero = tl.load(scale_zero_ptr + group_rows + groups, mask=in_k, other=0)
    scale = (scale_zero >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return words, scale, scale_zero & 0xFF


@triton.jit
def _tile_dot(words, scale, zero, a, exponent_bits, BLOCK_N, GROUPS, WORDS):
    """[GROUPS, BLOCK_N]: each group's and row's q - z dotted with the operand a [GROUPS, WORDS,
    8], times the group's scale."""
    zero = zero.to(tl.float32)[:, :, None]
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


# $1: the word; $2 / $3: 1024 + z / 64 + z as float16 pairs; $4..$7: the operand's pairs (p, p + 4)
# for p = 0..3. (a & b) | c is LOP3's table 0xEA.
_WORD_DOT_F16X2 = tl.constexpr(
    """
{
.reg .b32 t, v0, v1, v2, v3, s;
.reg .b16 lo, hi, h;
shr.u32 t, $1, 8;
lop3.b32 v0, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 v1, $1, 0x00F000F0, 0x54005400, 0xEA;
lop3.b32 v2, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 v3, t, 0x00F000F0, 0x54005400, 0xEA;
sub.f16x2 v0, v0, $2;
sub.f16x2 v1, v1, $3;
sub.f16x2 v2, v2, $2;
sub.f16x2 v3, v3, $3;
mul.f16x2 s, v0, $4;
fma.rn.f16x2 s, v1, $5, s;
fma.rn.f16x2 s, v2, $6, s;
fma.rn.f16x2 s, v3, $7, s;
mov.b32 {lo, hi}, s;
add.f16 h, lo, hi;
cvt.f32.f16 $0, h;
}
"""
)


@triton.jit
def _operand_pairs(a, GROUPS, WORDS):
    """The operand a [GROUPS, WORDS, 8], each word's eight scaled by a power of two that brings
    their largest magnitude into [128, 256), as float16 pairs (p, p + 4) in int32 [GROUPS, WORDS]
    for p = 0..3, and the inverse powers [GROUPS, WORDS]."""
    largest = tl.max(tl.abs(a), 2)
    exponent = tl.minimum(tl.maximum(largest.to(tl.int32, bitcast=True) >> 23, 8), 254)
    up = ((261 - exponent) << 23).to(tl.float32, bitcast=True)
    down = ((exponent - 7) << 23).to(tl.float32, bitcast=True)
    halves = (a * up[:, :, None]).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    low, high = tl.split(tl.permute(tl.reshape(halves, [GROUPS, WORDS, 2, 4]), 0, 1, 3, 2))
    pairs = tl.reshape(low | (high << 16), [GROUPS, WORDS, 2, 2])  # pair p at [.., p // 2, p % 2]
    even, odd = tl.split(pairs)
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0, a1, a2, a3, down


@triton.jit
def _tile_dot_f16x2(words, scale, zero, a, GROUPS, WORDS):
    """[GROUPS, BLOCK_N, WORDS]: each word's q - z dotted with its eight operand columns (a
    [GROUPS, WORDS, 8]) in half-precision pairs by inline PTX, times the group's scale. Summed
    over words once, after K: a sum per tile would shuffle between the threads of a group."""
    a0, a1, a2, a3, down = _operand_pairs(a, GROUPS, WORDS)
    zero = zero.to(tl.int32)
    low_planes = ((0x6400 + zero) * 0x10001)[:, :, None]
    high_planes = ((0x5400 + zero * 16) * 0x10001)[:, :, None]
    sums = tl.inline_asm_elementwise(
        _WORD_DOT_F16X2,
        "=r,r,r,r,r,r,r,r",
        [words, low_planes, high_planes, a0[:, None], a1[:, None], a2[:, None], a3[:, None]],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )
    return sums * (scale[:, :, None] * down[:, None, :])


@triton.jit
def stream_rows_dot_int4(
    x_ptr,
    words_ptr,
    norm_w_ptr,
    scale_zero_ptr,
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
    F16X2: tl.constexpr = False,
):
    """float32 [BLOCK_N]: the 4-bit rows `rows` (int64; words_ptr: the packed bytes as int32)
    dotted with the operand over inputs k_start..k_end (whole K tiles; all of K with the norm,
    whose scale is applied, as `backend.kernels.gemv_stream.stream_rows_dot`). BLOCK_K is a
    multiple of GROUP. With the merge prologue (3) the operand is split attention's partials,
    merged as they are read (`backend.kernels.gemv_operand.merged_operand`). The first K tile is
    read before the PDL wait (weights are never written by a kernel), and each next one while the
    current one is summed. F16X2: words unpacked in half-precision pairs by inline PTX (compiled
    CUDA only)."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP  # groups per K tile
    WORDS: tl.constexpr = GROUP // 8  # words per group
    k_start = tl.full([], k_start, tl.int32)  # a tensor for `_tile`'s alignment hint
    words_in_tile = tl.arange(0, GROUPS)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    # K is a multiple of 64 (`StreamedWeight.takes`): rows start 16-byte aligned, 4 words a load
    word_rows = words_ptr + rows[None, :, None] * tl.multiple_of(K // 8, 8)
    group_rows = rows[None, :] * (K // GROUP)
    inputs = 8 * words_in_tile[:, :, None] + tl.arange(0, 8)[None, None, :]  # [GROUPS, WORDS, 8]
    if PDL and EARLY_LAUNCH:
        gdc_launch_dependents()
    words, scale, zero = _tile(
        word_rows, group_rows, scale_zero_ptr, k_start, k_end, words_in_tile, GROUP, GROUPS
    )
    if PDL and not SKIP_WAIT:
        gdc_wait()
    square_sum = tl.zeros([1], tl.float32)
    if F16X2:
        acc = tl.zeros([GROUPS, BLOCK_N, WORDS], tl.float32)
    else:
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
            scale_zero_ptr,
            k0 + BLOCK_K,
            k_end,
            words_in_tile,
            GROUP,
            GROUPS,
        )
        if F16X2:
            acc += _tile_dot_f16x2(words, scale, zero, a, GROUPS, WORDS)
        else:
            acc += _tile_dot(words, scale, zero, a, exponent_bits, BLOCK_N, GROUPS, WORDS)
        words, scale, zero = next_words, next_scale, next_zero
    if PDL and not EARLY_LAUNCH:
        gdc_launch_dependents()
    if F16X2:
        acc = tl.sum(acc, 2)
    acc = tl.sum(acc, 0)
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(square_sum / K + eps)
    return acc

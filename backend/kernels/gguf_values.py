"""GGUF blocks de-quantized in registers (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), for the kernels
that read them kept quantized (`gguf_gemv` for one row, `gguf_matmul` for several).

A block's columns are the places that one load serves: Q8_0's 32 values; the 16 bytes of 4-bit
pairs of Q4_0, Q4_1 and Q5_0 (a byte's low nibble is value j, its high one j + 16); Q4_K's 128
bytes (two values each, of two sub-blocks); Q6_K's 64 lanes, each of which holds four values in
two low-bit bytes and one high-bit byte. So a block's values come in PARTS: part p of column c is
the block's value `part_index(c, p)`. Tiles are [rows, units, lanes]: a unit is one of a block's
GROUPS runs of LANES columns (column = 32 group + lane), so what a sub-block shares is read once
per unit. A kernel loads each block's scales once (`block_scales`, [rows, units, 1]) and the
bytes its parts share once (`shared_bytes`), then takes each part's weights (`part_values`).
The layouts are `backend.gguf_blocks`'s, the reference decoders, and each value is computed
with their float32 operations in their order. Float16 scales are read through a float16 view of
the same rows (every block starts at an even byte).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backend.gguf_blocks import BLOCK_TYPES

KERNEL_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q4_K": 4, "Q6_K": 5}
COLUMNS = {"Q8_0": 32, "Q4_0": 16, "Q4_1": 16, "Q5_0": 16, "Q4_K": 128, "Q6_K": 64}
PARTS = {"Q8_0": 1, "Q4_0": 2, "Q4_1": 2, "Q5_0": 2, "Q4_K": 2, "Q6_K": 4}
# Units of a block: Q4_K's pairs of 32-value sub-blocks, Q6_K's halves of 128 values.
GROUPS = {"Q8_0": 1, "Q4_0": 1, "Q4_1": 1, "Q5_0": 1, "Q4_K": 4, "Q6_K": 2}
LANES = {name: COLUMNS[name] // GROUPS[name] for name in KERNEL_TYPES}


def blocks_of_128_values(quant_type: str) -> int:
    """The blocks of a row a kernel step takes by default: 128 values' worth (4 of 32, 1 of 256)."""
    return max(1, 128 // BLOCK_TYPES[quant_type].block_size)


def type_constexprs(quant_type: str) -> dict:
    """The constexprs a kernel over `quant_type` blocks is launched with."""
    kind = BLOCK_TYPES[quant_type]
    return dict(
        QUANT=KERNEL_TYPES[quant_type],
        TYPE_SIZE=kind.type_size,
        VALUES=kind.block_size,
        GROUPS=GROUPS[quant_type],
        LANES=LANES[quant_type],
        PARTS=PARTS[quant_type],
    )


@triton.jit
def _byte(q_ptr, at, ok):
    return tl.load(q_ptr + at, mask=ok, other=0).to(tl.int32)


@triton.jit
def _f16(scale_ptr, at, ok):
    """The float16 at byte `at` (even), widened."""
    return tl.load(scale_ptr + at // 2, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def shared_bytes(q_ptr, start, col, ok, QUANT: tl.constexpr):
    """The bytes every part of a column reads: Q8_0's int8 value, the 4-bit pair of Q4_0 / Q4_1
    / Q5_0, Q4_K's pair, Q6_K's high-bit byte. `start` [rows, units, 1]: each unit's block's
    first byte; `col` [1, units, lanes]; int32 [rows, units, lanes]."""
    if QUANT <= 1:  # Q8_0, Q4_0: after d
        at = 2
    elif QUANT == 2:
        at = 4
    elif QUANT == 3:
        at = 6
    elif QUANT == 4:
        at = 16
    else:
        at = 128
    return _byte(q_ptr, start + at + col, ok)


@triton.jit
def part_index(col, QUANT: tl.constexpr, PART: tl.constexpr):
    """The place in its block of column col's part PART."""
    if QUANT == 0:
        index = col
    elif QUANT <= 3:
        index = col + 16 * PART
    elif QUANT == 4:
        index = 64 * (col // 32) + 32 * PART + col % 32
    else:
        index = 128 * (col // 32) + 32 * PART + col % 32
    return index


@triton.jit
def block_scales(q_ptr, scale_ptr, start, ok, QUANT: tl.constexpr):
    """Each block's (d, second): float32 [rows, units, 1] d, and Q4_1's m, Q5_0's 32 fifth
    bits (int32), Q4_K's dmin; else 0. Q4_K's sub-block scales and Q6_K's are read per part."""
    if QUANT == 5:
        d = _f16(scale_ptr, start + 208, ok)
    else:
        d = _f16(scale_ptr, start, ok)
    if QUANT == 2 or QUANT == 4:
        second = _f16(scale_ptr, start + 2, ok)
    elif QUANT == 3:  # bit j: value j's fifth bit
        second = _byte(q_ptr, start + 2, ok) | (_byte(q_ptr, start + 3, ok) << 8)
        second |= (_byte(q_ptr, start + 4, ok) << 16) | (_byte(q_ptr, start + 5, ok) << 24)
    else:
        second = d * 0.0
    return d, second


@triton.jit
def _q4_k_scale_min(q_ptr, start, group, ok, PART: tl.constexpr):
    """Q4_K's 6-bit scale and min of sub-block 2 group + PART, from its 12 bytes at start + 4:
    bytes 0-3 the low 6 bits of scales 0-3 and the high 2 of scales 4-7, bytes 4-7 the same for
    the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high
    nibble)."""
    sub = 2 * group + PART
    hi_sc = _byte(q_ptr, start + 4 + sub % 4, ok)
    hi_mn = _byte(q_ptr, start + 8 + sub % 4, ok)
    low = _byte(q_ptr, start + 12 + sub % 4, ok)
    sc = tl.where(sub < 4, hi_sc & 0x3F, (low & 0x0F) | ((hi_sc >> 2) & 0x30))
    mn = tl.where(sub < 4, hi_mn & 0x3F, (low >> 4) | ((hi_mn >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _int8(q_ptr, at, ok):
    byte = _byte(q_ptr, at, ok)
    return tl.where(byte > 127, byte - 256, byte)


@triton.jit
def part_values(
    q_ptr, start, group, lane, ok, d, second, shared, QUANT: tl.constexpr, PART: tl.constexpr
):
    """float32 [rows, units, lanes]: the weights of part PART (`d`, `second`: `block_scales`;
    `shared`: `shared_bytes`) at column 32 group + lane of each unit's block."""
    col = group * 32 + lane  # the K-quants' 32 lanes; others have one group
    if QUANT == 0:  # Q8_0: d, then 32 int8; q * d
        value = tl.where(shared > 127, shared - 256, shared).to(tl.float32) * d
    elif QUANT == 1:  # Q4_0: d, 16 bytes; (q - 8) * d
        value = d * (((shared >> (4 * PART)) & 0x0F) - 8).to(tl.float32)
    elif QUANT == 2:  # Q4_1: d, m, 16 bytes; d * q + m
        value = d * ((shared >> (4 * PART)) & 0x0F).to(tl.float32) + second
    elif QUANT == 3:  # Q5_0: d, 4 bytes of fifth bits, 16 bytes; (q - 16) * d
        fifth = (second >> (col + 16 * PART)) & 1
        value = d * ((((shared >> (4 * PART)) & 0x0F) | (fifth << 4)) - 16).to(tl.float32)
    elif QUANT == 4:  # Q4_K: d, dmin, 12 scale bytes, 128 bytes; (d * scale) * q - dmin * min
        sc, mn = _q4_k_scale_min(q_ptr, start, group, ok, PART)
        value = (d * sc) * ((shared >> (4 * PART)) & 0x0F).to(tl.float32) - second * mn
    else:  # Q6_K: 128 low-bit bytes, 64 high-bit bytes, 16 int8 scales, d; (d * scale) * (q - 32)
        # Lane w of group h: low 4 bits from byte 64 h + w (parts 0, 2: low, high nibble) or
        # 64 h + 32 + w (parts 1, 3), high 2 bits PART of its high-bit byte; a scale per 16
        # values: scale 8 h + 2 PART + w // 16.
        low = _byte(q_ptr, start + 64 * group + 32 * (PART % 2) + lane, ok) >> (4 * (PART // 2))
        q = (low & 0x0F) | (((shared >> (2 * PART)) & 3) << 4)
        first = _int8(q_ptr, start + 192 + 8 * group + 2 * PART, ok)
        second_scale = _int8(q_ptr, start + 193 + 8 * group + 2 * PART, ok)
        scale = tl.where(lane < 16, first, second_scale).to(tl.float32)
        value = (d * scale) * (q - 32).to(tl.float32)
    return value

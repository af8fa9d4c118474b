"""One-row linear layers over GGUF blocks kept quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K):
out = x @ W^T, each weight de-quantized in registers as it is read, so a decode step streams the
blocks (a quarter to a half of the bf16 bytes) and never writes a de-quantized weight.

One program owns BLOCK_N rows and walks all of K, BLOCKS blocks of each row per iteration. A
tile's columns are the places of a block that one load serves: Q8_0's 32 values; the 16 bytes
of 4-bit pairs of Q4_0, Q4_1 and Q5_0 (a byte's low nibble is value j, its high one j + 16);
Q4_K's 128 bytes (two values each, of two sub-blocks); Q6_K's 64 lanes, each of which holds four
values in two low-bit bytes and one high-bit byte. The layouts are `backend.gguf_blocks`'s, the
reference decoders. The float16 scales are read through a float16 view of the same rows (every
block starts at an even byte). Products accumulate elementwise in float32 and are summed over K
once, at the end, as in `backend.kernels.gemv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.gguf_blocks import BLOCK_TYPES

KERNEL_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q4_K": 4, "Q6_K": 5}
_COLUMNS = {"Q8_0": 32, "Q4_0": 16, "Q4_1": 16, "Q5_0": 16, "Q4_K": 128, "Q6_K": 64}


@triton.jit
def _x(x_ptr, index, col_ok):
    return tl.load(x_ptr + index, mask=col_ok, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _byte(q_ptr, at, ok):
    return tl.load(q_ptr + at, mask=ok, other=0).to(tl.int32)


@triton.jit
def _pairs(q_ptr, scale_ptr, x_ptr, start, first, col, ok, col_ok, QUANT: tl.constexpr):
    """Q4_0, Q4_1, Q5_0: byte `col` of the 16 holds values col (low nibble) and col + 16."""
    d = tl.load(scale_ptr + start // 2, mask=ok, other=0.0).to(tl.float32)
    if QUANT == 2:  # Q4_1: d, m, 16 bytes; d * q + m
        packed = _byte(q_ptr, start + 4 + col[None, :], ok)
        m = tl.load(scale_ptr + start // 2 + 1, mask=ok, other=0.0).to(tl.float32)
        low = d * (packed & 0x0F).to(tl.float32) + m
        high = d * (packed >> 4).to(tl.float32) + m
    elif QUANT == 1:  # Q4_0: d, 16 bytes; (q - 8) * d
        packed = _byte(q_ptr, start + 2 + col[None, :], ok)
        low = d * ((packed & 0x0F) - 8).to(tl.float32)
        high = d * ((packed >> 4) - 8).to(tl.float32)
    else:  # Q5_0: d, 4 bytes of fifth bits (bit j of value j), 16 bytes; (q - 16) * d
        packed = _byte(q_ptr, start + 6 + col[None, :], ok)
        fifth_low = _byte(q_ptr, start + 2 + (col // 8)[None, :], ok) >> (col % 8)[None, :]
        fifth_high = _byte(q_ptr, start + 4 + (col // 8)[None, :], ok) >> (col % 8)[None, :]
        low = d * (((packed & 0x0F) | ((fifth_low & 1) << 4)) - 16).to(tl.float32)
        high = d * (((packed >> 4) | ((fifth_high & 1) << 4)) - 16).to(tl.float32)
    return low * _x(x_ptr, first + col, col_ok) + high * _x(x_ptr, first + 16 + col, col_ok)


@triton.jit
def _q4_k_scale_min(q_ptr, start, sub, ok):
    """Q4_K's 6-bit scale and min of sub-block `sub` (0-7) from its 12 bytes at start + 4: bytes
    0-3 the low 6 bits of scales 0-3 and the high 2 of scales 4-7, bytes 4-7 the same for the
    mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    t = (sub % 4)[None, :]
    hi_sc = _byte(q_ptr, start + 4 + t, ok)
    hi_mn = _byte(q_ptr, start + 8 + t, ok)
    low = _byte(q_ptr, start + 12 + t, ok)
    first = (sub < 4)[None, :]
    sc = tl.where(first, hi_sc & 0x3F, (low & 0x0F) | ((hi_sc >> 2) & 0x30))
    mn = tl.where(first, hi_mn & 0x3F, (low >> 4) | ((hi_mn >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4_k(q_ptr, scale_ptr, x_ptr, start, first, col, ok, col_ok):
    """Q4_K: d, dmin, 12 scale bytes, 128 bytes; byte col = 32 g + w holds values 64 g + w (low
    nibble, sub-block 2 g) and 64 g + 32 + w (high, 2 g + 1); (d * scale) * q - dmin * min."""
    d = tl.load(scale_ptr + start // 2, mask=ok, other=0.0).to(tl.float32)
    dmin = tl.load(scale_ptr + start // 2 + 1, mask=ok, other=0.0).to(tl.float32)
    group, lane = col // 32, col % 32
    packed = _byte(q_ptr, start + 16 + col[None, :], ok)
    total = tl.zeros(packed.shape, tl.float32)
    for half in tl.static_range(2):
        sc, mn = _q4_k_scale_min(q_ptr, start, 2 * group + half, ok)
        q = ((packed >> (4 * half)) & 0x0F).to(tl.float32)
        value = (d * sc) * q - dmin * mn
        total += value * _x(x_ptr, first + 64 * group + 32 * half + lane, col_ok)
    return total


@triton.jit
def _q6_k(q_ptr, scale_ptr, x_ptr, start, first, col, ok, col_ok):
    """Q6_K: 128 low-bit bytes, 64 high-bit bytes, 16 int8 scales, d. Lane col = 32 h + w holds
    values 128 h + 32 k + w (k = 0-3): low 4 bits from byte 64 h + w (k = 0 low nibble, k = 2
    high) or 64 h + 32 + w (k = 1, 3), high 2 bits k of byte 128 + 32 h + w; (d * scale) *
    (q - 32), a scale per 16 values."""
    d = tl.load(scale_ptr + (start + 208) // 2, mask=ok, other=0.0).to(tl.float32)
    half, lane = col // 32, col % 32
    high_bits = _byte(q_ptr, start + 128 + col[None, :], ok)
    total = tl.zeros(high_bits.shape, tl.float32)
    for k in tl.static_range(4):
        low_bits = _byte(q_ptr, start + (64 * half + 32 * (k % 2) + lane)[None, :], ok)
        q = ((low_bits >> (4 * (k // 2))) & 0x0F) | (((high_bits >> (2 * k)) & 3) << 4)
        index = 128 * half + 32 * k + lane
        scale = _byte(q_ptr, start + 192 + (index // 16)[None, :], ok)
        scale = tl.where(scale > 127, scale - 256, scale).to(tl.float32)  # int8
        value = (d * scale) * (q - 32).to(tl.float32)
        total += value * _x(x_ptr, first + index, col_ok)
    return total


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    N,
    num_blocks,
    row_bytes,
    QUANT: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    VALUES: tl.constexpr,
    COLUMNS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_start = tl.where(row_ok, rows, 0).to(tl.int64) * row_bytes
    cols = tl.arange(0, BLOCKS * COLUMNS)
    tile_block, col = cols // COLUMNS, cols % COLUMNS
    acc = tl.zeros([BLOCK_N, BLOCKS * COLUMNS], tl.float32)
    for b0 in range(0, num_blocks, BLOCKS):
        block = b0 + tile_block
        col_ok = block < num_blocks
        ok = row_ok[:, None] & col_ok[None, :]
        start = row_start[:, None] + block[None, :].to(tl.int64) * TYPE_SIZE  # block's first byte
        first = block * VALUES  # the block's first value in x
        if QUANT == 0:  # Q8_0: d, then 32 int8
            d = tl.load(scale_ptr + start // 2, mask=ok, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + start + 2 + col[None, :], mask=ok, other=0)
            acc += (q.to(tl.int8, bitcast=True).to(tl.float32) * d) * _x(x_ptr, first + col, col_ok)
        elif QUANT <= 3:
            acc += _pairs(q_ptr, scale_ptr, x_ptr, start, first, col, ok, col_ok, QUANT)
        elif QUANT == 4:
            acc += _q4_k(q_ptr, scale_ptr, x_ptr, start, first, col, ok, col_ok)
        else:
            acc += _q6_k(q_ptr, scale_ptr, x_ptr, start, first, col, ok, col_ok)
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def gguf_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    quant_type: str,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 16,
    blocks: int | None = None,
) -> torch.Tensor:
    """x [1, K] -> x @ dequantize(qweight)^T (+ bias) [1, N] in x's dtype; qweight uint8
    [N, K / values per block * bytes per block] of `quant_type` (one of KERNEL_TYPES). `blocks`
    per iteration: by default 128 values' worth (4 of 32, 1 of 256)."""
    kind = BLOCK_TYPES[quant_type]
    num_blocks = x.shape[-1] // kind.block_size
    assert x.shape[0] == 1 and x.shape[-1] == num_blocks * kind.block_size and x.is_contiguous()
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous()
    assert qweight.shape[1] == num_blocks * kind.type_size
    n = qweight.shape[0]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        qweight,
        qweight.view(torch.float16),
        bias if bias is not None else x,
        out,
        n,
        num_blocks,
        qweight.shape[1],
        QUANT=KERNEL_TYPES[quant_type],
        TYPE_SIZE=kind.type_size,
        VALUES=kind.block_size,
        COLUMNS=_COLUMNS[quant_type],
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCKS=blocks or max(1, 128 // kind.block_size),
    )
    return out

"""One-row linear layers over GGUF blocks kept quantized (Q8_0, Q4_1): out = x @ W^T, each weight
de-quantized in registers as it is read, so a decode step streams the blocks (a quarter to a half
of the bf16 bytes) and never writes a de-quantized weight.

One program owns BLOCK_N rows and walks all of K, BLOCKS blocks of each row per iteration; the
tile's columns are the bytes of those blocks. The float16 scales are read through a float16 view
of the same rows (every block starts at an even byte). Products accumulate elementwise in float32
and are summed over K once, at the end, as in `backend.kernels.gemv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Q8_0, Q4_1 = 0, 1
KERNEL_TYPES = {"Q8_0": Q8_0, "Q4_1": Q4_1}
_LAYOUT = {Q8_0: (34, 32), Q4_1: (20, 16)}  # bytes per block, quantized bytes per block


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
    BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_start = tl.where(row_ok, rows, 0).to(tl.int64) * row_bytes
    cols = tl.arange(0, BLOCKS * BYTES)
    tile_block, byte = cols // BYTES, cols % BYTES
    acc = tl.zeros([BLOCK_N, BLOCKS * BYTES], tl.float32)
    for b0 in range(0, num_blocks, BLOCKS):
        block = b0 + tile_block
        col_ok = block < num_blocks
        ok = row_ok[:, None] & col_ok[None, :]
        start = row_start[:, None] + block[None, :].to(tl.int64) * TYPE_SIZE  # block's first byte
        d = tl.load(scale_ptr + start // 2, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + block * 32 + byte, mask=col_ok, other=0.0).to(tl.float32)
        if QUANT == 0:  # Q8_0: d, then 32 int8
            q = tl.load(q_ptr + start + 2 + byte[None, :], mask=ok, other=0)
            acc += (q.to(tl.int8, bitcast=True).to(tl.float32) * d) * x[None, :]
        else:  # Q4_1: d, m, then 16 bytes: low nibbles are values 0-15, high ones 16-31
            m = tl.load(scale_ptr + start // 2 + 1, mask=ok, other=0.0).to(tl.float32)
            packed = tl.load(q_ptr + start + 4 + byte[None, :], mask=ok, other=0)
            x_high = tl.load(x_ptr + block * 32 + 16 + byte, mask=col_ok, other=0.0)
            low = d * (packed & 0x0F).to(tl.float32) + m
            high = d * (packed >> 4).to(tl.float32) + m
            acc += low * x[None, :] + high * x_high.to(tl.float32)[None, :]
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
    blocks: int = 4,
) -> torch.Tensor:
    """x [1, K] -> x @ dequantize(qweight)^T (+ bias) [1, N] in x's dtype; qweight uint8
    [N, K / 32 * bytes per block] of `quant_type` (one of KERNEL_TYPES)."""
    quant = KERNEL_TYPES[quant_type]
    type_size, quant_bytes = _LAYOUT[quant]
    num_blocks = x.shape[-1] // 32
    assert x.shape[0] == 1 and x.shape[-1] == num_blocks * 32 and x.is_contiguous()
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous()
    assert qweight.shape[1] == num_blocks * type_size
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
        QUANT=quant,
        TYPE_SIZE=type_size,
        BYTES=quant_bytes,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCKS=blocks,
    )
    return out

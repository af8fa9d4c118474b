"""GGUF blocks de-quantized on the GPU in one kernel (`backend.kernels.gguf_values`' decoders),
for steps too long for the GEMM over blocks (prefill), which then multiply with cuBLAS. The torch
decoders of `backend.gguf_blocks` take a dozen passes over float32 intermediates instead."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.gguf_blocks import BLOCK_TYPES
from backend.kernels.gguf_values import (
    block_scales,
    part_index,
    part_values,
    shared_bytes,
    type_constexprs,
)


@triton.jit
def _gguf_dequantize_kernel(
    q_ptr,
    scale_ptr,
    out_ptr,
    N,
    num_blocks,
    row_bytes,
    QUANT: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    VALUES: tl.constexpr,
    GROUPS: tl.constexpr,
    LANES: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    unit = tl.arange(0, BLOCKS * GROUPS)[None, :, None]
    tile_block, group = unit // GROUPS, unit % GROUPS
    lane = tl.arange(0, LANES)[None, None, :]
    col = group * 32 + lane  # the K-quants' 32 lanes; others have one group
    block = tl.program_id(1) * BLOCKS + tile_block
    ok = (rows < N)[:, None, None] & (block < num_blocks)
    row = tl.where(rows < N, rows, 0).to(tl.int64)[:, None, None]
    start = row * row_bytes + block.to(tl.int64) * TYPE_SIZE  # each block's first byte
    out_row = out_ptr + row * num_blocks * VALUES + block * VALUES
    d, second = block_scales(q_ptr, scale_ptr, start, ok, QUANT)
    shared = shared_bytes(q_ptr, start, col, ok, QUANT)
    for part in tl.static_range(PARTS):
        w = part_values(q_ptr, start, group, lane, ok, d, second, shared, QUANT, part)
        out = out_row + part_index(col, QUANT, part)
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=ok)


def gguf_dequantize(
    qweight: torch.Tensor, quant_type: str, dtype: torch.dtype, block_n: int = 16
) -> torch.Tensor:
    """uint8 [N, row bytes] of `quant_type` blocks (one of KERNEL_TYPES) -> [N, K] in `dtype`."""
    kind = BLOCK_TYPES[quant_type]
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous()
    n, num_blocks = qweight.shape[0], qweight.shape[1] // kind.type_size
    out = torch.empty(n, num_blocks * kind.block_size, dtype=dtype, device=qweight.device)
    blocks = max(1, 256 // kind.block_size)
    _gguf_dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(num_blocks, blocks))](
        qweight,
        qweight.view(torch.float16),
        out,
        n,
        num_blocks,
        qweight.shape[1],
        **type_constexprs(quant_type),
        BLOCK_N=block_n,
        BLOCKS=blocks,
    )
    return out

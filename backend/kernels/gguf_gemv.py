"""One-row linear layers over GGUF blocks kept quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K):
out = x @ W^T, each weight de-quantized in registers as it is read, so a decode step streams the
blocks (a quarter to a half of the bf16 bytes) and never writes a de-quantized weight.

A program owns BLOCK_N rows and walks K, or its share of K (a split: the last program of a row
block to arrive adds the partial sums in split order, `split_k`), BLOCKS blocks of each row per
iteration, each block's values in parts (`backend.kernels.gguf_values`). Products accumulate
elementwise in float32 and are summed over K once, at the end, as in `backend.kernels.gemv`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend.gguf_blocks import BLOCK_TYPES
from backend.kernels.gguf_values import (
    block_scales,
    blocks_of_128_values,
    part_index,
    part_values,
    shared_bytes,
    type_constexprs,
)
from backend.kernels.split_k import split_launch, store_tile
from backend.kernels.tuning import device_name, lookup, shape_key


@triton.jit
def _x(x_ptr, index, col_ok):
    return tl.load(x_ptr + index, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    arrivals_ptr,
    N,
    num_blocks,
    row_bytes,
    blocks_per_split,
    QUANT: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    VALUES: tl.constexpr,
    GROUPS: tl.constexpr,
    LANES: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = (rows < N)[:, None, None]
    row_start = tl.where(rows < N, rows, 0).to(tl.int64)[:, None, None] * row_bytes
    unit = tl.arange(0, BLOCKS * GROUPS)[None, :, None]
    tile_block, group = unit // GROUPS, unit % GROUPS
    lane = tl.arange(0, LANES)[None, None, :]
    col = group * 32 + lane  # the K-quants' 32 lanes; others have one group
    acc = tl.zeros([BLOCK_N, BLOCKS * GROUPS, LANES], tl.float32)
    b_start = tl.program_id(1) * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, num_blocks)
    for b0 in range(b_start, b_end, BLOCKS):
        block = b0 + tile_block
        block_ok = block < b_end
        ok = row_ok & block_ok
        start = row_start + block.to(tl.int64) * TYPE_SIZE  # each block's first byte
        d, second = block_scales(q_ptr, scale_ptr, start, ok, QUANT)
        shared = shared_bytes(q_ptr, start, col, ok, QUANT)
        for part in tl.static_range(PARTS):
            w = part_values(q_ptr, start, group, lane, ok, d, second, shared, QUANT, part)
            acc += w * _x(x_ptr, block * VALUES + part_index(col, QUANT, part), block_ok)
    y = tl.sum(tl.sum(acc, 2), 1)[:, None]  # out^T's [BLOCK_N, 1] tile
    store_tile(
        y, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tl.arange(0, 1), rows, 1, N, HAS_BIAS, SPLIT
    )


@dataclass(frozen=True)
class GGUFGemvConfig:
    """A launch: weight rows per program, blocks of each row per iteration, warps."""

    block_n: int = 16
    blocks: int = 0  # 0: gguf_values.blocks_of_128_values
    num_warps: int = 4
    split: int = 1  # programs along K; a row block's last to arrive adds their partial sums


def config_key(quant_type: str, n: int, k: int) -> str:
    return shape_key(type=quant_type, n=n, k=k)


@functools.lru_cache(maxsize=None)
def _tuned(device: str | None, key: str) -> GGUFGemvConfig | None:
    entry = lookup("gguf_gemv", key, device)
    return GGUFGemvConfig(**entry) if entry is not None else None


def gguf_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    quant_type: str,
    bias: torch.Tensor | None = None,
    config: GGUFGemvConfig | None = None,
) -> torch.Tensor:
    """x [1, K] -> x @ dequantize(qweight)^T (+ bias) [1, N] in x's dtype; qweight uint8
    [N, K / values per block * bytes per block] of `quant_type` (one of KERNEL_TYPES). Config:
    the given one, the device's tuned one (`tuning/gguf_gemv.json`, from `python -m
    benchmarks.quantized_matmul --rows 1 --sweep`), else the default."""
    kind = BLOCK_TYPES[quant_type]
    num_blocks = x.shape[-1] // kind.block_size
    assert x.shape[0] == 1 and x.shape[-1] == num_blocks * kind.block_size and x.is_contiguous()
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous()
    assert qweight.shape[1] == num_blocks * kind.type_size
    n = qweight.shape[0]
    key = config_key(quant_type, n, x.shape[-1])
    c = config or _tuned(device_name(x.device), key) or GGUFGemvConfig()
    blocks = c.blocks or blocks_of_128_values(quant_type)
    launch = split_launch("gguf_gemv", num_blocks, c.split, blocks, n, c.block_n, x.device)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gguf_gemv_kernel[launch.grid](
        x,
        qweight,
        qweight.view(torch.float16),
        bias if bias is not None else x,
        out,
        *launch.buffers(out),
        n,
        num_blocks,
        qweight.shape[1],
        launch.per_split,  # in blocks
        **type_constexprs(quant_type),
        HAS_BIAS=bias is not None,
        SPLIT=launch.split,
        BLOCK_N=c.block_n,
        BLOCKS=blocks,
        num_warps=c.num_warps,
    )
    return out

"""Linear layers over GGUF blocks kept quantized, for steps of several rows: out = x @ W^T, each
weight tile de-quantized in registers (`backend.kernels.gguf_values`) and fed to the tensor cores
in x's dtype, so the step reads the blocks and never writes a de-quantized weight. One-row steps
take the GEMV (`backend.kernels.gguf_gemv`) instead.

As the 4-bit GEMM (`backend.kernels.int4_matmul`), a program computes a tile of out^T = W x^T:
the weights of one part of BLOCKS blocks per row, [BLOCK_N, BLOCKS x columns], are the dot's
first operand against the x columns that part holds (a gather: the pairs of Q4_0 hold values j
and j + 16), the step's rows the narrow side; K may be split over programs, in whole blocks
(`split_k`). Launch configs per device and shape: `tuning/gguf_gemm.json`, from
`python -m benchmarks.quantized_matmul --formats gguf_q4_k ... --sweep --write-tuning`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend.gguf_blocks import BLOCK_TYPES
from backend.kernels.gguf_values import (
    COLUMNS,
    block_scales,
    blocks_of_128_values,
    part_index,
    part_values,
    shared_bytes,
    type_constexprs,
)
from backend.kernels.split_k import split_launch, store_tile
from backend.kernels.tuning import device_name, lookup, rows_bucket, shape_key


@dataclass(frozen=True)
class GGUFGemmConfig:
    """A launch: its tiles (in blocks along K), K split, warps and stages."""

    block_n: int = 64  # weight rows (output columns) per program
    block_m: int = 64  # x rows per program
    blocks: int = 4  # blocks of each weight row per K step
    split: int = 1  # programs along K; the tile's last to arrive adds their partial sums
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _gguf_gemm_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    arrivals_ptr,
    M,
    N,
    num_blocks,
    row_bytes,
    stride_xm,
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
    BLOCK_M: tl.constexpr,
    BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    # Rows and columns past the edge read row 0 (never stored); only K's last step is masked.
    row_start = tl.where(n < N, n, 0).to(tl.int64)[:, None, None] * row_bytes
    x_rows = x_ptr + tl.where(m < M, m, 0).to(tl.int64)[:, None, None] * stride_xm
    unit = tl.arange(0, BLOCKS * GROUPS)[None, :, None]
    tile_block, group = unit // GROUPS, unit % GROUPS
    lane = tl.arange(0, LANES)[None, None, :]
    col = group * 32 + lane  # the K-quants' 32 lanes; others have one group
    b_start = tl.program_id(1) * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, num_blocks)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for b0 in range(b_start, b_end, BLOCKS):
        block = b0 + tile_block
        ok = block < b_end
        start = row_start + block.to(tl.int64) * TYPE_SIZE  # each block's first byte
        d, second = block_scales(q_ptr, scale_ptr, start, ok, QUANT)
        shared = shared_bytes(q_ptr, start, col, ok, QUANT)
        for part in tl.static_range(PARTS):
            x = tl.load(x_rows + block * VALUES + part_index(col, QUANT, part), mask=ok, other=0.0)
            w = part_values(q_ptr, start, group, lane, ok, d, second, shared, QUANT, part)
            w = tl.reshape(w.to(x.dtype), (BLOCK_N, BLOCKS * GROUPS * LANES))
            x = tl.reshape(x, (BLOCK_M, BLOCKS * GROUPS * LANES))
            acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)
    store_tile(acc, out_ptr, bias_ptr, part_ptr, arrivals_ptr, m, n, M, N, HAS_BIAS, SPLIT)


def config_key(quant_type: str, n: int, k: int, m: int) -> str:
    return shape_key(type=quant_type, n=n, k=k, rows=rows_bucket(m))


@functools.lru_cache(maxsize=None)
def _tuned(device: str | None, key: str) -> GGUFGemmConfig | None:
    entry = lookup("gguf_gemm", key, device)
    return GGUFGemmConfig(**entry) if entry is not None else None


def default_config(m: int, n: int, quant_type: str) -> GGUFGemmConfig:
    """Steps of 128 values per row (one block of 256 for the K-quants); narrow projections split
    K over four programs, so their few output tiles still spread over the SMs."""
    return GGUFGemmConfig(
        block_m=min(64, rows_bucket(m)),
        blocks=blocks_of_128_values(quant_type),
        split=4 if n <= 4096 else 1,
    )


def gguf_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    quant_type: str,
    bias: torch.Tensor | None = None,
    config: GGUFGemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] -> x @ dequantize(qweight)^T (+ bias) [M, N] in x's dtype; qweight uint8
    [N, K / values per block * bytes per block] of `quant_type` (one of KERNEL_TYPES). Config:
    the given one, the device's tuned one, else `default_config`."""
    kind = BLOCK_TYPES[quant_type]
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    num_blocks = k // kind.block_size
    assert x.dim() == 2 and k == num_blocks * kind.block_size and x.stride(1) == 1
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous()
    assert qweight.shape[1] == num_blocks * kind.type_size
    key = config_key(quant_type, n, k, m)
    c = config or _tuned(device_name(x.device), key) or default_config(m, n, quant_type)
    assert c.blocks * COLUMNS[quant_type] >= 16, "dot operands are 16 or more columns"
    launch = split_launch(
        "gguf_gemm", num_blocks, c.split, c.blocks, n, c.block_n, x.device, m, c.block_m
    )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gguf_gemm_kernel[launch.grid](
        x,
        qweight,
        qweight.view(torch.float16),
        bias if bias is not None else x,
        out,
        *launch.buffers(out),
        m,
        n,
        num_blocks,
        qweight.shape[1],
        x.stride(0),
        launch.per_split,  # in blocks
        **type_constexprs(quant_type),
        HAS_BIAS=bias is not None,
        SPLIT=launch.split,
        BLOCK_N=c.block_n,
        BLOCK_M=c.block_m,
        BLOCKS=c.blocks,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 steps stay float32
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    return out

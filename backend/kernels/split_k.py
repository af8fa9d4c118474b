"""K split over programs for the swapped GEMMs (`fp8_gemm`, `int4_matmul`): each program of an
output tile writes its float32 partial sum, and the last of the tile's programs to arrive (an
arrival counter, `backend.kernels.arrivals`) adds them all in split order, so the sum is the
same whichever program arrives last, and no second kernel is launched to add them.

Tiles are out^T's: acc [BLOCK_N, BLOCK_M] for output columns n and rows m; partial sums are kept
as [SPLIT, M, N] float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend.kernels.arrivals import arrival_counters


@dataclass(frozen=True)
class SwappedGemmConfig:
    """A launch of a swapped GEMM: its tiles, K split, warps and stages."""

    block_n: int = 64  # weight rows (output columns) per program
    block_m: int = 64  # activation rows per program
    block_k: int = 128
    split: int = 1  # programs along K; the tile's last to arrive adds their partial sums
    num_warps: int = 4
    num_stages: int = 3

    def launch_args(self, split: int) -> dict:
        """The kernel's tile constexprs and launch options, for `split` programs along K."""
        return dict(
            SPLIT=split,
            BLOCK_N=self.block_n,
            BLOCK_M=self.block_m,
            BLOCK_K=self.block_k,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


@triton.jit
def add_split_partials(acc, part_ptr, arrivals_ptr, m, n, M, N, SPLIT: tl.constexpr):
    """(whether this program is its tile's last to arrive, the sum of the tile's partial sums
    in split order: meaningful only for the last)."""
    ok = (m < M)[None, :] & (n < N)[:, None]
    split = tl.program_id(1)
    tl.store(part_ptr + (split * M + m[None, :]).to(tl.int64) * N + n[:, None], acc, mask=ok)
    # Every thread's stores are done (barrier) before one thread's acq_rel increment publishes
    # them.
    tl.debug_barrier()
    counter = arrivals_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    total = tl.zeros_like(acc)
    if last:
        tl.store(counter, 0)  # ready for the next launch
        for s in tl.static_range(SPLIT):
            part = part_ptr + (s * M + m[None, :]).to(tl.int64) * N + n[:, None]
            total += tl.load(part, mask=ok, other=0.0, cache_modifier=".cg")
    return last, total


@triton.jit
def _store_tile(acc, out_ptr, bias_ptr, m, n, M, N, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M], out^T's tile, plus the bias, into out [M, N]."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + tl.where(n < N, n, 0)).to(tl.float32)[:, None]
    out = out_ptr + m[None, :].to(tl.int64) * N + n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m < M)[None, :] & (n < N)[:, None])


@triton.jit
def store_tile(
    acc,
    out_ptr,
    bias_ptr,
    part_ptr,
    arrivals_ptr,
    m,
    n,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """A program's tile plus the bias into out [M, N]: directly without a split, else once its
    tile's last program has added the partial sums."""
    if SPLIT == 1:
        _store_tile(acc, out_ptr, bias_ptr, m, n, M, N, HAS_BIAS)
    else:
        last, total = add_split_partials(acc, part_ptr, arrivals_ptr, m, n, M, N, SPLIT)
        if last:
            _store_tile(total, out_ptr, bias_ptr, m, n, M, N, HAS_BIAS)


@dataclass(frozen=True)
class SplitLaunch:
    """A launch over (n tiles, K splits, m tiles): each split's share of K (in the kernel's own
    unit of K), the grid, and the partial sums and arrival counters of a split (None without)."""

    per_split: int
    grid: tuple[int, int, int]
    partials: torch.Tensor | None
    arrivals: torch.Tensor | None

    @property
    def split(self) -> int:
        return self.grid[1]

    def buffers(self, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial sums, counters) as kernel arguments; `placeholder` twice without a split."""
        if self.partials is None:
            return placeholder, placeholder
        return self.partials, self.arrivals


def split_launch(
    kernel: str,
    k: int,
    split: int,
    step: int,
    n: int,
    block_n: int,
    device: torch.device,
    m: int = 1,
    block_m: int = 1,
) -> SplitLaunch:
    """`kernel`'s launch over n outputs in tiles of block_n, m rows in tiles of block_m, and K (k
    of some unit) split `split` ways in whole steps of `step`: each split's share, whole steps."""
    per_split = triton.cdiv(triton.cdiv(k, split), step) * step
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, per_split), triton.cdiv(m, block_m))
    if grid[1] == 1:
        return SplitLaunch(per_split, grid, None, None)
    partials = torch.empty(grid[1], m, n, dtype=torch.float32, device=device)
    arrivals = arrival_counters(kernel, device, grid[0] * grid[2])
    return SplitLaunch(per_split, grid, partials, arrivals)

"""LoRA's batched product in two Triton-language kernels: y[rows] += (x[rows] @ A[slot]^T) @
B[slot]^T for the rows of each adapter slot, rows grouped by slot (S-LoRA / Punica's SGMV
shape).

The rows of a step under adapters come sorted by slot and cut into tiles of at most BLOCK_M
rows of one slot (`tile_plan`). Shrink: one program per (tile, rank tile) reads its rows of x
once per K tile and the slot's A, writing the float32 [rows, rank] intermediate. Expand: one
program per (tile, output tile) reads that and the slot's B, and adds into y's rows (each row is
in one tile, so no two programs write the same element). A slot of rank 0 for this projection
does nothing. Sums in float32.

Checked against the torch product under Triton's interpreter only: until a GPU run checks them,
the engine's adapted projections use the torch product (`backend.lora.linear_lora`) everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M = 16


@dataclass(frozen=True)
class TilePlan:
    rows: torch.Tensor  # [N] int64: the rows under an adapter, grouped by slot
    tile_slot: torch.Tensor  # [tiles] int32
    tile_start: torch.Tensor  # [tiles] int32: the tile's first index into `rows`
    tile_count: torch.Tensor  # [tiles] int32: its rows (<= BLOCK_M)


def tile_plan(token_slots: np.ndarray, device: torch.device) -> TilePlan:
    """token_slots [T]: each row's slot, -1 for none."""
    order = np.argsort(token_slots, kind="stable")
    order = order[token_slots[order] >= 0]
    slots = token_slots[order]
    starts, counts, tile_slots = [], [], []
    edges = np.flatnonzero(np.diff(slots)) + 1
    for begin, end in zip(np.r_[0, edges], np.r_[edges, slots.size]):
        for first in range(begin, end, BLOCK_M):
            starts.append(first)
            counts.append(min(BLOCK_M, end - first))
            tile_slots.append(slots[first])

    def to(values, dtype):
        return torch.tensor(np.asarray(values), dtype=dtype, device=device)

    return TilePlan(
        to(order, torch.int64),
        to(tile_slots, torch.int32),
        to(starts, torch.int32),
        to(counts, torch.int32),
    )


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_count_ptr, ranks_ptr, out_ptr,
    in_features, stride_x, stride_a_slot, stride_a_rank, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(1) * BLOCK_R < rank:
        start = tl.load(tile_start_ptr + tile)
        m = tl.arange(0, BLOCK_M)
        m_mask = m < tl.load(tile_count_ptr + tile)
        rows = tl.load(rows_ptr + start + m, mask=m_mask, other=0)
        r_mask = r < rank
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < in_features
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + k[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            a = tl.load(
                a_ptr + slot * stride_a_slot + r[None, :] * stride_a_rank + k[:, None],
                mask=r_mask[None, :] & k_mask[:, None],
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(x, a, input_precision="ieee")
        out = out_ptr + (start + m)[:, None] * stride_out + r[None, :]
        tl.store(out, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    shrunk_ptr, b_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_count_ptr, ranks_ptr, y_ptr,
    size, first, stride_shrunk, stride_b_slot, stride_b_row, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    if rank > 0:
        start = tl.load(tile_start_ptr + tile)
        m = tl.arange(0, BLOCK_M)
        m_mask = m < tl.load(tile_count_ptr + tile)
        rows = tl.load(rows_ptr + start + m, mask=m_mask, other=0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < size
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_mask = r < rank
            s = tl.load(
                shrunk_ptr + (start + m)[:, None] * stride_shrunk + r[None, :],
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + slot * stride_b_slot + n[None, :] * stride_b_row + r[:, None],
                mask=r_mask[:, None] & n_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(s, b, input_precision="ieee")
        mask = m_mask[:, None] & n_mask[None, :]
        y = y_ptr + rows[:, None] * stride_y + first + n[None, :]
        tl.store(
            y, (tl.load(y, mask=mask).to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask
        )


def shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """x [T, in], a [slots, max_rank, in], ranks [slots] int32 -> float32 [N, max_rank]: row i
    of `plan.rows` shrunk by its slot's A (columns past the slot's rank unwritten)."""
    max_rank, in_features = a.shape[1:]
    assert x.stride(1) == 1 and a.stride(2) == 1
    out = torch.empty(plan.rows.numel(), max_rank, dtype=torch.float32, device=x.device)
    block_r = max(16, min(64, triton.next_power_of_2(max_rank)))
    grid = (plan.tile_slot.numel(), triton.cdiv(max_rank, block_r))
    _shrink_kernel[grid](
        x, a, plan.rows, plan.tile_slot, plan.tile_start, plan.tile_count, ranks, out,
        in_features, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    return out


def expand_add(
    y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, first: int,
    plan: TilePlan,
) -> None:  # fmt: skip
    """y[rows, first : first + rows of b] += shrunk @ B[slot]^T, in place; b [slots, size,
    max_rank]."""
    size = b.shape[1]
    assert y.stride(1) == 1 and b.stride(2) == 1
    block_n = 64
    grid = (plan.tile_slot.numel(), triton.cdiv(size, block_n))
    _expand_kernel[grid](
        shrunk, b, plan.rows, plan.tile_slot, plan.tile_start, plan.tile_count, ranks, y,
        size, first, shrunk.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=16,
    )  # fmt: skip

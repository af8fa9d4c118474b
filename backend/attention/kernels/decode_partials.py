"""A split of paged decode attention's partial result, and the merge of a group's splits by the
last split to arrive (`backend.attention.kernels.decode`): each split stores its normalised
output and base-2 log-sum-exp per head, and the merger combines them with
`backend.kernels.split_merge`'s formula, the whole group at once while its partials are few,
else head by head. Loads bypass L1 (.cg): the partials were written by other programs."""

from __future__ import annotations

import triton
import triton.language as tl

from backend.kernels.split_merge import merge_splits


@triton.jit
def store_partial(
    part_out_ptr,
    part_lse_ptr,
    out,
    lse,
    seq,
    heads,
    head_ok,
    split,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One split's normalised output [GROUP_PAD, HEAD_DIM] and log-sum-exp (base 2) per head."""
    part = (seq * NUM_HEADS + heads) * num_splits + split  # [GROUP_PAD]
    dims = tl.arange(0, HEAD_DIM)
    tl.store(
        part_out_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
        out,
        mask=head_ok[:, None],
    )
    tl.store(part_lse_ptr + part, lse, mask=head_ok)


@triton.jit
def arrive_last(counter_ptr, used):
    """Count this split in on its (request, kv head)'s arrival counter; true for the last of the
    `used` splits to arrive, which sets the counter back to zero for the next launch. Every
    thread's stores are done (barrier) before one thread's acq_rel increment publishes them."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == used - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def merge_splits_of_group(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    row,
    seq,
    kv_head,
    used,
    num_splits,
    stride_o_h,
    stride_o_t,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    AT_ONCE: tl.constexpr,
):
    """The `used` splits of a (request, kv head) merged into out_ptr's row, all at once or head by
    head (`merge_group_splits`, `merge_splits_by_head`)."""
    if AT_ONCE:
        merge_group_splits(
            out_ptr,
            part_out_ptr,
            part_lse_ptr,
            row,
            seq,
            kv_head,
            used,
            num_splits,
            stride_o_h,
            stride_o_t,
            NUM_HEADS,
            GROUP,
            GROUP_POW2,
            HEAD_DIM,
            SPLITS_PAD,
        )
    else:
        merge_splits_by_head(
            out_ptr,
            part_out_ptr,
            part_lse_ptr,
            row,
            seq,
            kv_head,
            used,
            num_splits,
            stride_o_h,
            stride_o_t,
            NUM_HEADS,
            GROUP,
            HEAD_DIM,
            SPLITS_PAD,
        )


@triton.jit
def keep_only_first_split(
    part_lse_ptr,
    seq,
    kv_head,
    used,
    num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """After the group's splits were merged into split 0's partial: split 0 weighs 1, the other
    used splits nothing (the unused ones already do), so a consumer reads split 0 alone."""
    g = tl.arange(0, GROUP_POW2)
    splits = tl.arange(0, SPLITS_PAD)
    part = (seq * NUM_HEADS + kv_head * GROUP + g).to(tl.int64)[:, None] * num_splits + splits[
        None, :
    ]
    lse = tl.where(splits == 0, 0.0, float("-inf"))
    tl.store(
        part_lse_ptr + part,
        tl.broadcast_to(lse[None, :], [GROUP_POW2, SPLITS_PAD]),
        mask=(g < GROUP)[:, None] & (splits < used)[None, :],
    )


@triton.jit
def merge_group_splits(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    row,
    seq,
    kv_head,
    used,
    num_splits,
    stride_o_h,
    stride_o_t,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """`merge_splits_by_head` for the whole group at once: every head's partials are loaded together
    before anything is stored, one round trip instead of one per head (the per-head loop cannot
    hoist a head's loads above the previous head's store). For small groups x splits."""
    g = tl.arange(0, GROUP_POW2)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    ok = head_ok[:, None] & (splits < used)[None, :]  # [G, S]
    part = (seq * NUM_HEADS + heads).to(tl.int64)[:, None] * num_splits + splits[None, :]
    lse = tl.load(part_lse_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    parts = tl.load(
        part_out_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :],
        mask=ok[:, :, None],
        other=0.0,
        cache_modifier=".cg",
    )  # [G, S, D]
    out = merge_splits(parts, lse)
    tl.store(
        out_ptr + row * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None],
    )


@triton.jit
def merge_splits_by_head(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    row,
    seq,
    kv_head,
    used,
    num_splits,
    stride_o_h,
    stride_o_t,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """`backend.kernels.split_merge`'s formula, head by head, for groups x splits too many to
    hold at once. Loads bypass L1 (.cg): the partials were written by other programs."""
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < used
    dims = tl.arange(0, HEAD_DIM)
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        base = (seq * NUM_HEADS + head).to(tl.int64) * num_splits
        lse = tl.load(
            part_lse_ptr + base + splits, mask=split_ok, other=float("-inf"), cache_modifier=".cg"
        )
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        weight = tl.exp2(lse - lse_max)
        total = tl.sum(weight, 0)
        parts = tl.load(
            part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
            mask=split_ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + row * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty)
        )

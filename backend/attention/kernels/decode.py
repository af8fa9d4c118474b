"""Paged decode attention with split-K (flash-decoding), in one kernel.

Every request has one query token. With few requests, one program per (request, kv head) would
leave most SMs idle while each walks a long context, so the context is also split:

    grid = (num_seqs, num_kv_heads, num_splits)

A program takes the GQA group of query heads that share its kv head (padded to 16 rows for the
tensor-core dot), so each K/V tile is read once per group. The request's cached context (all its
tokens but the step's own, last one) is cut into key tiles of BLOCK_N tokens; a request uses at
most one split per MIN_TILES_PER_SPLIT tiles, up to `num_splits`, and divides its tiles evenly
among them, all from its own seq_len in the kernel, so any context length works for any
`num_splits` (a CUDA graph captured with a fixed split count stays valid) and splits past the
used ones exit at once. Each program runs the online softmax over its tiles in fp32; split 0 also
takes the step's own token.

Sliding window (`recent` = window - sinks, see prefill.py): the splits share the tiles from the
one holding the window's first key; split 0 also takes the sink tiles before the window. Without
a window `recent` is past any position and the tiles start at 0.

Programmatic dependent launch: the cached context was written by earlier steps and the step
inputs before any kernel of the layers launched (by the host, or by a decode CUDA graph's first
kernel, `backend.kernels.step_inputs`), so a program reads them, its first key tile included,
before it waits for the previous kernel; after the wait it reads the query and the step's own
key and value, which that kernel (the KV write, or the fused qkv projection) has just written.

A quantized cache (fp8 / int8, KV_SCALED) has its scales read with each key tile (tile.py) and
with the step's own key and value; under a 16-bit query an fp8 cache's tiles are read as words
and widened to float16 (F16_TILES, tile.py), with inline PTX on a GPU. Where the one-token path
hands over the step's keys and values unwritten (WRITES_NEW_KV), split 0 of each (request, kv
head) quantizes them into the cache itself (own_token.py), so no KV-write launch runs before it.

With one split used, the program writes the output itself. Otherwise each split writes a
normalised partial output and its log-sum-exp, and counts itself in on an arrival counter of its
(request, kv head); the last to arrive merges the splits,
    out = sum_s exp2(lse_s - max) * o_s / sum_s exp2(lse_s - max),
and sets the counter back to zero for the next launch: no separate reduce kernel per layer. While
the group's partials are few (up to MERGE_AT_ONCE_MAX_VALUES), the merger loads all of them in one
go, not head by head, which overlaps their loads. Left unmerged for the one-token o projection
(PARTIALS), a request's splits are merged here all the same where it uses more than
READ_MERGE_MAX_SPLITS of them: each program of that projection would read them all.

The grid's split count is a ceiling (`decode_launch`, from the longest context the launch may
see: a graph's is the capacity); what a request costs follows its own context, in the kernel.

How many splits, and the tiles, warps and stages per device: `decode_launch`. Measurements behind
these choices: benchmarks/README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.attention.kernels import decode_launch
from backend.attention.kernels.decode_partials import (
    arrive_last,
    keep_only_first_split,
    merge_splits_of_group,
    store_partial,
)
from backend.attention.kernels.kv_write import check_scales, quantize_rule
from backend.attention.kernels.own_token import own_key_value
from backend.attention.kernels.prefill import window_bounds
from backend.attention.kernels.tile import (
    attend_key_tile,
    attend_loaded_tile,
    exp2_scales,
    load_key_tile,
    scaled_scores,
)
from backend.attention.kv_dtype import is_scaled, widens_to_float16
from backend.kernels import tuning
from backend.kernels.arrivals import arrival_counters
from backend.kernels.pdl import Ordering, gdc_launch_dependents, gdc_wait, launch_options

MIN_TILES_PER_SPLIT = 1
MERGE_AT_ONCE_MAX_VALUES = 8192  # partials a merging program may hold at once
# The o projection merges at most this many splits as it reads them (each of its programs reads
# every head's); a request using more has them merged here first.
READ_MERGE_MAX_SPLITS = 4
ORDERING = Ordering("decode_attention", releases="before_wait", reads_step_inputs_before_wait=True)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    arrivals_ptr,
    new_k_ptr,
    new_v_ptr,
    qk_scale,
    recent,
    sinks,
    num_splits,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_new_t,
    stride_new_h,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_head,
    stride_s_block,
    stride_s_offset,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES_PER_SPLIT: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    MERGE_AT_ONCE: tl.constexpr = False,
    GROUP_POW2: tl.constexpr = 1,
    PARTIALS: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,
    KV_SCALED: tl.constexpr = False,
    SINGLE_ROWS_ONLY: tl.constexpr = False,
    F16_TILES: tl.constexpr = False,
    PTX: tl.constexpr = False,
    WRITES_NEW_KV: tl.constexpr = False,
    READ_MERGE_MAX: tl.constexpr = READ_MERGE_MAX_SPLITS,
    QMAX: tl.constexpr = 0.0,
    TO_INT: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # the next kernel (the o projection) may start streaming its weights now
        gdc_launch_dependents()

    # Step inputs and the cached context are written before the layers' kernels launch: read
    # them (and this split's first key tile) before waiting for the previous kernel.
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(query_start_ptr + seq).to(tl.int64)
    cached = tl.maximum(seq_len - 1, 0)
    cached_tiles = (cached + BLOCK_N - 1) // BLOCK_N
    key_lo = tl.maximum(seq_len - recent, 0)  # the window's first key
    first_tile = key_lo // BLOCK_N
    window_tiles = tl.maximum(cached_tiles - first_tile, 0)
    used = tl.minimum(
        tl.maximum((window_tiles + MIN_TILES_PER_SPLIT - 1) // MIN_TILES_PER_SPLIT, 1), num_splits
    )
    tiles_per_split = (window_tiles + used - 1) // used
    if SINGLE_ROWS_ONLY:  # a mixed step: requests of several rows are the prefill kernel's
        used = tl.where(tl.load(query_start_ptr + seq + 1) - row == 1, used, 0)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, cached_tiles)
    if split < used:
        block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        first_k, first_v, first_ok, first_ks, first_vs = load_key_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_table_row,
            kv_head,
            tile_lo * BLOCK_N,
            key_lo,
            tl.minimum(tile_hi * BLOCK_N, cached),
            stride_kc_block,
            stride_kc_offset,
            stride_kc_head,
            stride_vc_block,
            stride_vc_offset,
            stride_vc_head,
            k_scale_ptr,
            v_scale_ptr,
            stride_s_block,
            stride_s_offset,
            TOKENS_PER_BLOCK=TOKENS_PER_BLOCK,
            BLOCK_N=BLOCK_N,
            HEAD_DIM=HEAD_DIM,
            MASK_KEYS=True,
            KV_SCALED=KV_SCALED,
            F16_TILES=F16_TILES,
            PTX=PTX,
        )
        newest_page = tl.load(block_table_row + cached // TOKENS_PER_BLOCK).to(
            tl.int64
        )  # own token
        if PDL:
            gdc_wait()

        group_rows = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + group_rows
        head_ok = group_rows < GROUP
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + row * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
            mask=head_ok[:, None],
            other=0.0,
        )
        if not KV_SCALED:  # a quantized cache's values convert to q's dtype (or float16) instead
            q = q.to(k_cache_ptr.dtype.element_ty)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.full([GROUP_PAD], 0, tl.float32)
        acc = tl.full([GROUP_PAD, HEAD_DIM], 0, tl.float32)
        if tile_lo < tile_hi:
            m_i, l_i, acc = attend_loaded_tile(
                q,
                m_i,
                l_i,
                acc,
                first_k,
                first_v,
                first_ok,
                first_ks,
                first_vs,
                0,
                0,
                0,
                qk_scale,
                BLOCK_N=BLOCK_N,
                MASK_KEYS=True,
                CAUSAL=False,
                DOT_PRECISION=DOT_PRECISION,
                SOFTCAP=SOFTCAP,
                KV_SCALED=KV_SCALED,
                F16_TILES=F16_TILES,
            )
        for tile in range(tile_lo + 1, tile_hi):
            m_i, l_i, acc = attend_key_tile(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                block_table_row,
                kv_head,
                tile * BLOCK_N,
                key_lo,
                cached,
                0,
                0,
                qk_scale,
                stride_kc_block,
                stride_kc_offset,
                stride_kc_head,
                stride_vc_block,
                stride_vc_offset,
                stride_vc_head,
                k_scale_ptr,
                v_scale_ptr,
                stride_s_block,
                stride_s_offset,
                TOKENS_PER_BLOCK=TOKENS_PER_BLOCK,
                BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM,
                MASK_KEYS=True,
                CAUSAL=False,
                DOT_PRECISION=DOT_PRECISION,
                SOFTCAP=SOFTCAP,
                KV_SCALED=KV_SCALED,
                F16_TILES=F16_TILES,
                PTX=PTX,
            )
        sink_end = tl.minimum(sinks, key_lo)  # sinks before the window
        if split == 0:
            for start in range(0, sink_end, BLOCK_N):
                m_i, l_i, acc = attend_key_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    k_cache_ptr,
                    v_cache_ptr,
                    block_table_row,
                    kv_head,
                    start,
                    0,
                    sink_end,
                    0,
                    0,
                    qk_scale,
                    stride_kc_block,
                    stride_kc_offset,
                    stride_kc_head,
                    stride_vc_block,
                    stride_vc_offset,
                    stride_vc_head,
                    k_scale_ptr,
                    v_scale_ptr,
                    stride_s_block,
                    stride_s_offset,
                    TOKENS_PER_BLOCK=TOKENS_PER_BLOCK,
                    BLOCK_N=BLOCK_N,
                    HEAD_DIM=HEAD_DIM,
                    MASK_KEYS=True,
                    CAUSAL=False,
                    DOT_PRECISION=DOT_PRECISION,
                    SOFTCAP=SOFTCAP,
                    KV_SCALED=KV_SCALED,
                    F16_TILES=F16_TILES,
                    PTX=PTX,
                )
        if (split == 0) & (seq_len > 0):
            # The step's own token (position `cached`), own_token.py
            k_new, v_new = own_key_value(
                k_cache_ptr,
                v_cache_ptr,
                k_scale_ptr,
                v_scale_ptr,
                new_k_ptr,
                new_v_ptr,
                newest_page,
                cached % TOKENS_PER_BLOCK,
                kv_head,
                row,
                stride_new_t,
                stride_new_h,
                stride_kc_block,
                stride_kc_offset,
                stride_kc_head,
                stride_vc_block,
                stride_vc_offset,
                stride_vc_head,
                stride_s_block,
                stride_s_offset,
                HEAD_DIM,
                KV_SCALED,
                WRITES_NEW_KV,
                QMAX,
                TO_INT,
            )
            qk = tl.sum(q.to(tl.float32) * k_new[None, :], 1)
            score = scaled_scores(qk, qk_scale, SOFTCAP)
            m_new = tl.maximum(m_i, score)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(score - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new[None, :]
            m_i = m_new

        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        o_rows = out_ptr + row * stride_o_t + heads[:, None] * stride_o_h + dims[None, :]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        if PARTIALS:
            store_partial(
                part_out_ptr,
                part_lse_ptr,
                out,
                lse,
                seq,
                heads,
                head_ok,
                split,
                num_splits,
                NUM_HEADS,
                HEAD_DIM,
            )
            if used > READ_MERGE_MAX:
                # Too many for every program of the o projection to read: the last split merges
                # them into split 0, whose partial then stands alone (the others' lse -inf).
                if arrive_last(arrivals_ptr + seq * NUM_KV_HEADS + kv_head, used):
                    merge_splits_of_group(
                        part_out_ptr,
                        part_out_ptr,
                        part_lse_ptr,
                        seq,
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
                        MERGE_AT_ONCE,
                    )
                    tl.debug_barrier()  # every partial read before the lse are overwritten
                    keep_only_first_split(
                        part_lse_ptr,
                        seq,
                        kv_head,
                        used,
                        num_splits,
                        NUM_HEADS,
                        GROUP,
                        GROUP_POW2,
                        SPLITS_PAD,
                    )
        elif SINGLE_SPLIT:
            tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        elif used == 1:
            tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        else:
            store_partial(
                part_out_ptr,
                part_lse_ptr,
                out,
                lse,
                seq,
                heads,
                head_ok,
                split,
                num_splits,
                NUM_HEADS,
                HEAD_DIM,
            )
            if arrive_last(arrivals_ptr + seq * NUM_KV_HEADS + kv_head, used):
                merge_splits_of_group(
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
                    MERGE_AT_ONCE,
                )
    elif PARTIALS:
        # A split with no tiles of this request's context: its partial must weigh nothing. (After
        # the wait: with programmatic dependent launch an earlier kernel may still be reading
        # this memory, and once the previous kernel is done, all earlier ones are.)
        if PDL:
            gdc_wait()
        heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
        part = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(
            part_lse_ptr + part,
            tl.full([GROUP_PAD], float("-inf"), tl.float32),
            mask=tl.arange(0, GROUP_PAD) < GROUP,
        )
    elif SINGLE_ROWS_ONLY and PDL:
        gdc_wait()  # ends no sooner than the kernel before it, even where every request is skipped


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    min_tiles_per_split: int | None = None,
    window: int | None = None,
    sinks: int = 0,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    single_rows_only: bool = False,
) -> torch.Tensor:
    """One query token per request: query [T, heads, head_dim] -> [T, heads, head_dim].

    Request b's query row is query_start_loc[b]; its context is seq_lens[b] tokens (0 = padding
    row, whose output is zeros), the last of them the step's own token. `num_splits` overrides
    the heuristic (fix it for CUDA graphs); a request uses at most one split per
    `min_tiles_per_split` key tiles of its cached context (default MIN_TILES_PER_SPLIT).
    `window`: sliding-window attention with `sinks` (backend.attention.reference's rule).
    `k_scales`/`v_scales` [blocks, tokens_per_block, kv_heads]: a quantized cache's scales.
    `single_rows_only`: a mixed step; only requests of one query row are attended, the rows of
    the others left for `prefill_attention(single_rows_elsewhere=True)`.
    """
    num_kv_heads, num_seqs = k_cache.shape[2], seq_lens.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    config = decode_launch.config_for(query, k_cache, num_seqs)
    if num_splits is None:
        num_splits = decode_launch.splits_for(config, query, k_cache, num_seqs, max_seq_len)
    if num_splits == 1:
        part_out = part_lse = arrivals = out  # unused
    else:
        part_out, part_lse = _partials(query, num_seqs, num_splits)
        arrivals = arrival_counters("decode_attention", query.device, num_seqs * num_kv_heads)
    _launch(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        num_splits,
        out,
        part_out,
        part_lse,
        arrivals,
        min_tiles_per_split,
        partials=False,
        config=config,
        window=window,
        sinks=sinks,
        softcap=softcap,
        k_scales=k_scales,
        v_scales=v_scales,
        single_rows_only=single_rows_only,
    )
    return out


def decode_attention_partials(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    window: int | None = None,
    sinks: int = 0,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention` with the splits left unmerged, for a consumer that merges them as it
    reads them (the one-token o projection, `backend.kernels.gemv`): that saves the merge's
    arrival counter and second round trip.
    `new_kv`: the step's own keys and values [T, kv_heads, head_dim], not yet in a quantized
    cache; the kernel quantizes them into it (split 0 of each request and kv head), which saves
    the KV-write launch before it.
    Returns each split's normalised output [requests, heads, splits, head_dim] and its log-sum-exp
    in base 2 [requests, heads, splits], float32; -inf marks a split without keys (its output is
    unset). A request that used more than READ_MERGE_MAX_SPLITS splits (a long context) has them
    merged into split 0 already, the others marked -inf. The splits merge as
    out = sum_s exp2(lse_s - m) o_s / sum_s exp2(lse_s - m), m = max lse."""
    num_seqs = seq_lens.shape[0]
    config = decode_launch.config_for(query, k_cache, num_seqs)
    if num_splits is None:
        num_splits = decode_launch.splits_for(config, query, k_cache, num_seqs, max_seq_len)
    part_out, part_lse = _partials(query, num_seqs, num_splits)
    arrivals = part_lse  # unused
    if num_splits > READ_MERGE_MAX_SPLITS:
        arrivals = arrival_counters("decode_attention", query.device, num_seqs * k_cache.shape[2])
    if num_seqs:
        _launch(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            num_splits,
            part_out,
            part_out,
            part_lse,
            arrivals,
            None,
            partials=True,
            config=config,
            window=window,
            sinks=sinks,
            softcap=softcap,
            k_scales=k_scales,
            v_scales=v_scales,
            new_kv=new_kv,
        )
    return part_out, part_lse


def _partials(
    query: torch.Tensor, num_seqs: int, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    num_heads, head_dim = query.shape[1:]
    part_out = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(
        (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
    )
    return part_out, part_lse


def _launch(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    num_splits,
    out,
    part_out,
    part_lse,
    arrivals,
    min_tiles_per_split,
    partials: bool,
    config,
    window: int | None = None,
    sinks: int = 0,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    single_rows_only: bool = False,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    num_heads, head_dim = query.shape[1:]
    num_blocks, tokens_per_block, num_kv_heads = k_cache.shape[:3]
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and head_dim & (head_dim - 1) == 0 and head_dim >= 16
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    scaled = is_scaled(k_cache.dtype)
    qk_scale, softcap_log2 = exp2_scales(scale, softcap)
    if scaled:
        check_scales(k_cache, k_scales, v_scales)
    else:
        k_scales = v_scales = k_cache  # unused
    compute = query.dtype if scaled else k_cache.dtype  # the dots' operand dtype
    if new_kv is None:
        new_k = new_v = query  # unused
    else:
        new_k, new_v = new_kv
        assert scaled, "only a quantized cache takes the step's keys and values here"
        assert new_k.shape == new_v.shape == (query.shape[0], num_kv_heads, head_dim)
        assert new_k.stride() == new_v.stride() and new_k.stride(-1) == 1
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        arrivals,
        new_k,
        new_v,
        qk_scale,
        *window_bounds(window, sinks),
        num_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        new_k.stride(0),
        new_k.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *(k_scales.stride()[:2] if scaled else (0, 0)),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        TOKENS_PER_BLOCK=tokens_per_block,
        BLOCK_N=config["BLOCK_N"],
        MIN_TILES_PER_SPLIT=min_tiles_per_split or MIN_TILES_PER_SPLIT,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        SINGLE_SPLIT=num_splits == 1,
        PARTIALS=partials,
        SOFTCAP=softcap_log2,
        MERGE_AT_ONCE=(
            triton.next_power_of_2(group) * triton.next_power_of_2(num_splits) * head_dim
            <= MERGE_AT_ONCE_MAX_VALUES
        ),
        GROUP_POW2=triton.next_power_of_2(group),
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32",
        KV_SCALED=scaled,
        SINGLE_ROWS_ONLY=single_rows_only,
        F16_TILES=widens_to_float16(k_cache.dtype, query.dtype),
        PTX=tuning.compiles_for_gpu(query.device),
        WRITES_NEW_KV=new_kv is not None,
        **quantize_rule(k_cache.dtype),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **decode_launch.register_cap(config),
        **launch_options(ORDERING),
    )

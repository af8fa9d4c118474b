"""Causal attention for packed variable-length query chunks over a paged context.

Request b owns query rows query_start_loc[b]:query_start_loc[b+1] (q_len of them); they are the
last q_len positions of its context of seq_len tokens, all of which (an earlier chunk, a reused
prefix, the tokens just written) are read from the paged cache. Query i of the request sits at
absolute position seq_len - q_len + i and sees keys 0..that position.

Grid = (query tiles, num_kv_heads). A program takes BLOCK_Q consecutive query tokens of one request
together with all GROUP query heads that share its kv head, packed into BLOCK_M rows (a power of
two; BLOCK_Q = BLOCK_M // GROUP, leftover rows idle): row r is token r // GROUP, head r % GROUP,
so non-power-of-two groups (e.g. 7 heads per kv head) work too. Each K/V tile is
thus read once for the whole group, and a decode row (q_len 1) in a mixed batch still fills GROUP
rows. The query tiles of all requests are numbered without a host sync: request b's tiles start at
query_start_loc[b] // BLOCK_Q + b, which leaves room for its cdiv(q_len, BLOCK_Q) tiles, so
T // BLOCK_Q + num_seqs programs cover any batch; a program finds its request by binary search
over query_start_loc and exits if its tile is past the request's end.

Keys are walked in tiles of BLOCK_N tokens gathered through the block table, with an fp32 online
softmax (see tile.py; a quantized cache's scales are read with each tile, and under a 16-bit
query an fp8 cache's tiles are read as words and widened to float16). Key tiles below the
first query's position need no mask; the last few, up to the tile's last query position, get the
causal mask; tiles fully above the diagonal are never visited.

Sliding window (`recent` = window - sinks): query at position q sees keys q - recent < k <= q,
and the sinks k < sinks. Key tiles wholly before the first row's window are never visited; the
tiles up to the last row's window start get the per-row window mask; the sinks before a row's
window are a separate pass over the first tiles. Without a window `recent` is past any position.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from backend.attention.kernels.kv_write import check_scales
from backend.attention.kernels.tile import attend_key_tile, exp2_scales
from backend.attention.kv_dtype import is_scaled, widens_to_float16
from backend.kernels import tuning


@triton.jit
def _find_request(query_start_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= tile_id (binary search)."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid
        else:
            hi = mid - 1
    return lo


# The step's request count and block-table width change from step to step: specialising on
# them (== 1, divisible by 16) would compile a variant per combination while serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    qk_scale,
    recent,
    sinks,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_head,
    stride_s_block,
    stride_s_offset,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
    KV_SCALED: tl.constexpr = False,
    SINGLE_ROWS_ELSEWHERE: tl.constexpr = False,
    F16_TILES: tl.constexpr = False,
    PTX: tl.constexpr = False,
):
    # Longest first: a request's last tiles see the most keys, so the last wave holds short tiles.
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_request(query_start_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    if SINGLE_ROWS_ELSEWHERE:  # the decode kernel attends requests of one row
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len  # absolute position of the request's first query

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # query index within the request
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_start + q_idx
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if not KV_SCALED:  # a quantized cache's values convert to the query's dtype instead
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0, tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    first_pos = context_start + q_tile * BLOCK_Q  # every row of the tile sees keys < first_pos
    key_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    row_key_lo = tl.maximum(q_pos - recent + 1, 0)  # each row's first key in its window
    first_lo = tl.maximum(first_pos - recent + 1, 0)  # the smallest of them
    last_lo = tl.maximum(key_end - recent, 0)  # the largest
    window_start = (first_lo // BLOCK_N) * BLOCK_N
    window_masked_end = tl.maximum(
        tl.minimum(tl.cdiv(last_lo, BLOCK_N) * BLOCK_N, unmasked_end), window_start
    )
    sink_end = tl.minimum(sinks, last_lo)  # sinks before some row's window
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
            tl.minimum(sinks, row_key_lo) - 1,  # keys past a row's window start: not here
            tl.zeros_like(row_key_lo),
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
            CAUSAL=True,
            DOT_PRECISION=DOT_PRECISION,
            SOFTCAP=SOFTCAP,
            KV_SCALED=KV_SCALED,
            F16_TILES=F16_TILES,
            PTX=PTX,
        )
    for start in range(window_start, window_masked_end, BLOCK_N):
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
            first_lo,
            key_end,
            q_pos,
            row_key_lo,
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
            CAUSAL=True,
            DOT_PRECISION=DOT_PRECISION,
            SOFTCAP=SOFTCAP,
            KV_SCALED=KV_SCALED,
            F16_TILES=F16_TILES,
            PTX=PTX,
        )
    for start in range(window_masked_end, unmasked_end, BLOCK_N):
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
            first_lo,
            key_end,
            q_pos,
            row_key_lo,
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
            MASK_KEYS=False,
            CAUSAL=False,
            DOT_PRECISION=DOT_PRECISION,
            SOFTCAP=SOFTCAP,
            KV_SCALED=KV_SCALED,
            F16_TILES=F16_TILES,
            PTX=PTX,
        )
    for start in range(unmasked_end, key_end, BLOCK_N):
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
            first_lo,
            key_end,
            q_pos,
            row_key_lo,
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
            CAUSAL=True,
            DOT_PRECISION=DOT_PRECISION,
            SOFTCAP=SOFTCAP,
            KV_SCALED=KV_SCALED,
            F16_TILES=F16_TILES,
            PTX=PTX,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # idle rows (l_i = 0) store zeros
    o_ptrs = out_ptr + q_rows[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


SHARED_MEMORY_BUDGET = 112 * 1024  # bytes of staged tiles; the compiler adds its own buffers on top


def default_launch_config(group: int, head_dim: int, element_size: int = 2) -> dict:
    """Tile shape for devices without a table entry: 64 x 64, 4 warps, up to 3 stages
    (benchmarks/README.md, "Kernel choices"). Stages are capped so the Q tile plus the staged K/V
    tiles fit in shared memory (else the launch fails: out of resources)."""
    block_m, block_n = max(64, triton.next_power_of_2(group)), 64
    q_bytes = block_m * head_dim * element_size
    kv_stage_bytes = 2 * block_n * head_dim * element_size
    stages = max(1, min(3, (SHARED_MEMORY_BUDGET - q_bytes) // kv_stage_bytes))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=stages)


def tuning_key(group: int, head_dim: int, element_size: int) -> str:
    """The shape key of `tuning/prefill_attention.json`."""
    return tuning.shape_key(group=group, head_dim=head_dim, element_size=element_size)


@functools.lru_cache(maxsize=None)
def launch_config(
    group: int, head_dim: int, element_size: int, device_name: str | None = None
) -> Mapping:
    """The table's config on the named device, else the default; read-only, cached."""
    config = tuning.lookup(
        "prefill_attention", tuning_key(group, head_dim, element_size), device_name
    )
    return MappingProxyType(config or default_launch_config(group, head_dim, element_size))


NO_WINDOW = 1 << 30  # `recent` for global attention: past any position


def window_bounds(window: int | None, sinks: int) -> tuple[int, int]:
    """The kernels' (recent, sinks): a query sees the last `recent` tokens and the sinks."""
    if window is None:
        return NO_WINDOW, 0
    if not 0 <= sinks < window:
        raise ValueError(f"sinks must be in [0, window), got sinks {sinks} for window {window}")
    return window - sinks, sinks


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    sinks: int = 0,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    single_rows_elsewhere: bool = False,
) -> torch.Tensor:
    """query [T, heads, head_dim] -> [T, heads, head_dim]; any mix of query lengths (>= 0).
    `window`: sliding-window attention with `sinks` (backend.attention.reference's rule).
    `k_scales`/`v_scales` [blocks, tokens_per_block, kv_heads]: a quantized cache's scales.
    `single_rows_elsewhere`: requests of one query row are left unwritten, for
    `decode_attention(single_rows_only=True)`."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and head_dim & (head_dim - 1) == 0 and head_dim >= 16
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    scaled = is_scaled(k_cache.dtype)
    if scaled:
        check_scales(k_cache, k_scales, v_scales)
    else:
        k_scales = v_scales = k_cache  # unused
    compute = query.dtype if scaled else k_cache.dtype  # the dots' operand dtype
    config = launch_config(group, head_dim, compute.itemsize, tuning.device_name(query.device))
    block_m = block_m or config["BLOCK_M"]
    block_n = block_n or config["BLOCK_N"]
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_seqs
    qk_scale, softcap_log2 = exp2_scales(scale, softcap)
    _prefill_kernel[(num_tiles, num_kv_heads)](
        query,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        qk_scale,
        *window_bounds(window, sinks),
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *(k_scales.stride()[:2] if scaled else (0, 0)),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        TOKENS_PER_BLOCK=k_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32",
        SOFTCAP=softcap_log2,
        KV_SCALED=scaled,
        SINGLE_ROWS_ELSEWHERE=single_rows_elsewhere,
        F16_TILES=widens_to_float16(k_cache.dtype, query.dtype),
        PTX=tuning.compiles_for_gpu(query.device),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out

"""The inner step shared by the decode and prefill kernels: one key tile of online softmax.

A program holds a tile of query rows `q` [M, head_dim] that all read the same kv head, and the
running state of the online (streaming) softmax, in fp32 and in base 2:
    m_i  [M]            running max of the scaled scores,
    l_i  [M]            running sum of exp2(score - m_i),
    acc  [M, head_dim]  running sum of exp2(score - m_i) * value.
`attend_key_tile` gathers BLOCK_N consecutive context tokens from the paged cache (token j lives
in physical block `block_table[j // TOKENS_PER_BLOCK]` at offset `j % TOKENS_PER_BLOCK`, so a tile
may span several pages; tiles start at multiples of BLOCK_N, so where BLOCK_N divides
TOKENS_PER_BLOCK a tile lies in one page), scores them, rescales the state to the new max and
adds the tile's contribution. The caller divides acc by l_i at the end (or keeps m_i + log2(l_i)
as the log-sum-exp of a split).
`load_key_tile` and `attend_loaded_tile` are the two halves, for a caller that loads a tile early
(the decode kernel reads its first tile before waiting for the previous kernel).

MASK_KEYS masks tokens before `key_start` or at or past `key_end` (loads return 0 so stale cache
rows, even NaN, and freed blocks outside a sliding window never reach the sums); CAUSAL
additionally hides keys above each row's absolute position `q_pos` and below its `row_key_lo`
(the first key of the row's sliding window; 0 without one). Tiles that need neither run without
masks. A row that has seen no visible key yet keeps m_i = -inf, l_i = 0, acc = 0.

KV_SCALED: the cache holds fp8 / int8 values with a scale per token and kv head
(`backend.attention.kv_dtype`), loaded with the tile. The values convert exactly to the query's
dtype for the dots, and the scales multiply the [M, BLOCK_N] scores and probabilities instead of
the [BLOCK_N, head_dim] tiles: (q . k) * k_scale, and (p * v_scale) @ v.

F16_TILES (an e4m3 cache): the tiles are read as int32 words of four values and widened to
float16 in registers, two values an instruction with PTX (`cvt.rn.f16x2.e4m3x2`, exact) on a
GPU, with Triton's casts under the interpreter; the dots then run in float16. Read as bytes,
each 8-bit tile reached the dot's layout through shared memory one element at a time, and the
kernel was bound by those instructions, not by the bytes it read (benchmarks/README.md). The
probabilities are scaled by v_scale / max(v_scale) (the max multiplies the tile's product) so
they stay in float16's normal range.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def _widen_e4m3_words(words, PTX: tl.constexpr):
    """[rows, W] int32 words, four e4m3 values each -> [rows, 4 W] float16 in memory order."""
    if PTX:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r",
            [words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        b0 = _e4m3_byte(words, 0)
        b1 = _e4m3_byte(words, 8)
        b2 = _e4m3_byte(words, 16)
        b3 = _e4m3_byte(words, 24)
    # join adds the minor axis: [W, 2 (b0|b1 vs b2|b3), 2 (b0|b2 vs b1|b3)] flattens to b0 b1 b2 b3
    quads = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    return tl.reshape(quads, (words.shape[0], 4 * words.shape[1]))


@triton.jit
def _e4m3_byte(words, shift: tl.constexpr):
    byte = ((words >> shift) & 0xFF).to(tl.uint8)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _load_e4m3_tile(
    cache_ptr,
    first,
    rows,
    key_ok,
    HEAD_DIM: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    PTX: tl.constexpr,
):
    """One e4m3 [BLOCK_N, HEAD_DIM] tile as float16; each row's first value at int32 word
    `first + rows` (`first` a scalar or [BLOCK_N], `rows` [BLOCK_N])."""
    words_ptr = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + first
    ptrs = (words_ptr + rows)[:, None] + tl.arange(0, HEAD_DIM // 4)[None, :]
    if MASK_KEYS:
        words = tl.load(ptrs, mask=key_ok[:, None], other=0)
    else:
        words = tl.load(ptrs)
    return _widen_e4m3_words(words, PTX)


@triton.jit
def load_key_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table_row,
    kv_head,
    tile_start,
    key_start,
    key_end,
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
    TOKENS_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    KV_SCALED: tl.constexpr = False,
    F16_TILES: tl.constexpr = False,
    PTX: tl.constexpr = False,
):
    """Keys and values [BLOCK_N, HEAD_DIM] of context tokens tile_start.. (zeros outside
    [key_start, key_end) when MASK_KEYS; float16 with F16_TILES), which tokens are real
    ([BLOCK_N] bool), and the keys' and values' scales ([BLOCK_N] float32; ones when not
    KV_SCALED)."""
    tokens = tile_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    key_ok = (tokens < key_end) & (tokens >= key_start)
    if TOKENS_PER_BLOCK % BLOCK_N == 0:
        # The tile lies in one page: one page number, so each address is that page's base plus
        # a 32-bit offset, not a 64-bit product per token.
        page = tl.load(
            block_table_row + tile_start // TOKENS_PER_BLOCK, mask=tile_start < key_end, other=0
        ).to(tl.int64)
        in_page = tile_start % TOKENS_PER_BLOCK + tl.arange(0, BLOCK_N)
    else:
        if MASK_KEYS:
            page = tl.load(block_table_row + tokens // TOKENS_PER_BLOCK, mask=key_ok, other=0)
        else:
            page = tl.load(block_table_row + tokens // TOKENS_PER_BLOCK)
        page = page.to(tl.int64)
        in_page = tokens % TOKENS_PER_BLOCK
    # Each token's first value: its page's row 0 for this head (one offset when the tile lies in
    # one page) plus its row in the page.
    k_first = page * stride_kc_block + kv_head * stride_kc_head
    v_first = page * stride_vc_block + kv_head * stride_vc_head
    if F16_TILES:  # in int32 words of four values
        k_words = in_page * (stride_kc_offset // 4)
        v_words = in_page * (stride_vc_offset // 4)
        k = _load_e4m3_tile(k_cache_ptr, k_first // 4, k_words, key_ok, HEAD_DIM, MASK_KEYS, PTX)
        v = _load_e4m3_tile(v_cache_ptr, v_first // 4, v_words, key_ok, HEAD_DIM, MASK_KEYS, PTX)
    else:
        k_rows = in_page * stride_kc_offset
        v_rows = in_page * stride_vc_offset
        k_ptrs = (k_cache_ptr + k_first + k_rows)[:, None] + dims[None, :]
        v_ptrs = (v_cache_ptr + v_first + v_rows)[:, None] + dims[None, :]
        if MASK_KEYS:
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    if KV_SCALED:
        s_first = page * stride_s_block + kv_head
        s_rows = in_page * stride_s_offset
        k_scale_ptrs = k_scale_ptr + s_first + s_rows
        v_scale_ptrs = v_scale_ptr + s_first + s_rows
        if MASK_KEYS:
            k_scale = tl.load(k_scale_ptrs, mask=key_ok, other=0.0).to(tl.float32)
            v_scale = tl.load(v_scale_ptrs, mask=key_ok, other=0.0).to(tl.float32)
        else:
            k_scale = tl.load(k_scale_ptrs).to(tl.float32)
            v_scale = tl.load(v_scale_ptrs).to(tl.float32)
    else:
        k_scale = tl.full([BLOCK_N], 1.0, tl.float32)
        v_scale = tl.full([BLOCK_N], 1.0, tl.float32)
    return k, v, key_ok, k_scale, v_scale


def exp2_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, SOFTCAP) for `scaled_scores`: the kernels score in base 2 (exp2)."""
    if softcap is None:
        return scale * LOG2_E, 0.0
    return scale / softcap, softcap * LOG2_E


@triton.jit
def scaled_scores(qk, qk_scale, SOFTCAP: tl.constexpr = 0.0):
    """q.k -> base-2 scores: qk * qk_scale, and with SOFTCAP (cap * log2 e; qk_scale is then
    scale / cap) tanh soft-capped: cap * tanh(qk * scale / cap) * log2 e."""
    scores = qk * qk_scale
    if SOFTCAP > 0:
        scores = (2.0 * tl.sigmoid(2.0 * scores) - 1.0) * SOFTCAP  # tanh, from what Triton has
    return scores


@triton.jit
def attend_loaded_tile(
    q,
    m_i,
    l_i,
    acc,
    k,
    v,
    key_ok,
    k_scale,
    v_scale,
    tile_start,
    q_pos,
    row_key_lo,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
    KV_SCALED: tl.constexpr = False,
    F16_TILES: tl.constexpr = False,
):
    """The online-softmax update with one loaded tile (`load_key_tile`)."""
    if F16_TILES:
        qk = tl.dot(q.to(tl.float16), tl.trans(k), input_precision=DOT_PRECISION)
        qk = qk * k_scale[None, :]
    elif KV_SCALED:
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        qk = qk * k_scale[None, :]
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    scores = scaled_scores(qk, qk_scale, SOFTCAP)  # [M, BLOCK_N]
    if CAUSAL:
        tokens = tile_start + tl.arange(0, BLOCK_N)
        visible = (tokens[None, :] <= q_pos[:, None]) & (tokens[None, :] >= row_key_lo[:, None])
        if MASK_KEYS:
            visible = visible & key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    elif MASK_KEYS:
        scores = tl.where(key_ok[None, :], scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2(-inf) = 0, not NaN
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(scores - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F16_TILES:
        v_top = tl.max(v_scale, 0)
        v_top = tl.where(v_top > 0, v_top, 1.0)
        pv = tl.dot(
            (p * (v_scale / v_top)[None, :]).to(tl.float16), v, input_precision=DOT_PRECISION
        )
        pv = pv * v_top
    elif KV_SCALED:
        pv = tl.dot(
            (p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def attend_key_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row,
    kv_head,
    tile_start,
    key_start,
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
    TOKENS_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
    KV_SCALED: tl.constexpr = False,
    F16_TILES: tl.constexpr = False,
    PTX: tl.constexpr = False,
):
    """Load one tile and update the state with it."""
    k, v, key_ok, k_scale, v_scale = load_key_tile(
        k_cache_ptr,
        v_cache_ptr,
        block_table_row,
        kv_head,
        tile_start,
        key_start,
        key_end,
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
        MASK_KEYS=MASK_KEYS,
        KV_SCALED=KV_SCALED,
        F16_TILES=F16_TILES,
        PTX=PTX,
    )
    return attend_loaded_tile(
        q,
        m_i,
        l_i,
        acc,
        k,
        v,
        key_ok,
        k_scale,
        v_scale,
        tile_start,
        q_pos,
        row_key_lo,
        qk_scale,
        BLOCK_N=BLOCK_N,
        MASK_KEYS=MASK_KEYS,
        CAUSAL=CAUSAL,
        DOT_PRECISION=DOT_PRECISION,
        SOFTCAP=SOFTCAP,
        KV_SCALED=KV_SCALED,
        F16_TILES=F16_TILES,
    )

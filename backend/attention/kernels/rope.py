"""Rotary position embedding of q and k, in place, in one pass per token.

Llama-style ("rotate half"): for each head with dims split into halves x1 = x[:D/2], x2 = x[D/2:],
    x1' = x1 * cos - x2 * sin,   x2' = x2 * cos + x1 * sin,
with cos/sin of the token's position read from the float32 cache of
`backend.layers.rotary.RotaryEmbedding` ([max_positions, 2, D], cos then sin, each the frequency
vector repeated twice, so only its first half is read). One program per token rotates all query
and kv heads; q and k may be strided views into the fused QKV projection output, which is then
updated without copies. Arithmetic is float32 with one rounding to the activation dtype.

With `kv_write`, the same program also stores the token's rotated keys and its values at its
paged-cache slot (the layout of `backend.attention.metadata`; slot -1, a padded row, is skipped),
which saves the separate KV-write kernel per layer; a quantized cache (fp8 / int8) gets each head
vector quantized with its own scale, as `backend.attention.kernels.kv_write` stores it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.attention.kernels.kv_write import (
    check_scales,
    quantize_by,
    quantize_rule,
    quantize_vectors,
    vector_scales,
)
from backend.attention.kv_dtype import is_scaled
from backend.kernels.pdl import Ordering, gdc_launch_dependents, gdc_wait, launch_options

ORDERING = Ordering("apply_rotary_", releases="after_wait")


@triton.jit
def _rotate_heads(
    ptr,
    token,
    stride_t,
    stride_h,
    cos,
    sin,
    cache_ptr,
    stride_c_h,
    slot,
    scale_ptr,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    TO_CACHE: tl.constexpr,
    QMAX: tl.constexpr,
    TO_INT: tl.constexpr,
):
    """Rotate one token's heads in place; with TO_CACHE also store them at `cache_ptr` (unless
    `slot` < 0, a padded row), quantized with each head's scale at `scale_ptr` when QMAX > 0."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    first = ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(ptr.dtype.element_ty)
    tl.store(first, y1, mask=mask)
    tl.store(first + HALF, y2, mask=mask)
    if TO_CACHE:
        if slot >= 0:
            cached = cache_ptr + heads * stride_c_h + dims
            if QMAX > 0:
                _store_quantized(
                    cached, HALF, y1, y2, scale_ptr, NUM_HEADS, HEADS_PAD, QMAX, TO_INT
                )
            else:
                tl.store(cached, y1.to(cache_ptr.dtype.element_ty), mask=mask)
                tl.store(cached + HALF, y2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_quantized(
    cached, HALF, first, second, scale_ptr, NUM_HEADS, HEADS_PAD, QMAX: tl.constexpr, TO_INT
):
    """Head vectors given as halves [heads, HALF] -> a quantized cache's values and scales, as
    `kv_write` stores them."""
    first = first.to(tl.float32)
    second = second.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(first), 1), tl.max(tl.abs(second), 1))
    scale = vector_scales(amax, QMAX)
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < NUM_HEADS)[:, None]
    stored = cached.dtype.element_ty
    tl.store(cached, quantize_by(first, scale, QMAX, TO_INT).to(stored), mask=mask)
    tl.store(cached + HALF, quantize_by(second, scale, QMAX, TO_INT).to(stored), mask=mask)
    tl.store(scale_ptr + heads, scale.to(scale_ptr.dtype.element_ty), mask=heads < NUM_HEADS)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    positions_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cs_pos,
    stride_cs_kind,
    stride_v_t,
    stride_v_h,
    stride_c_block,
    stride_c_offset,
    stride_c_head,
    stride_s_block,
    stride_s_offset,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    WRITE_KV: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    QMAX: tl.constexpr = 0.0,
    TO_INT: tl.constexpr = False,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + position * stride_cs_pos + dims)
    sin = tl.load(cos_sin_ptr + position * stride_cs_pos + stride_cs_kind + dims)
    _rotate_heads(
        q_ptr,
        token,
        stride_q_t,
        stride_q_h,
        cos,
        sin,
        q_ptr,
        0,
        -1,
        q_ptr,
        NUM_HEADS,
        HEADS_PAD,
        HALF,
        False,
        0.0,
        False,
    )
    slot = tl.load(slot_ptr + token).to(tl.int64)
    in_cache = tl.where(slot >= 0, slot, 0)
    block = in_cache // TOKENS_PER_BLOCK
    offset = in_cache % TOKENS_PER_BLOCK
    cache_offset = block * stride_c_block + offset * stride_c_offset
    scale_offset = block * stride_s_block + offset * stride_s_offset
    _rotate_heads(
        k_ptr,
        token,
        stride_k_t,
        stride_k_h,
        cos,
        sin,
        k_cache_ptr + cache_offset,
        stride_c_head,
        slot,
        k_scale_ptr + scale_offset,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HALF,
        WRITE_KV,
        QMAX,
        TO_INT,
    )
    if WRITE_KV:
        if slot >= 0:
            heads = tl.arange(0, KV_HEADS_PAD)[:, None]
            full_dims = tl.arange(0, 2 * HALF)[None, :]
            mask = heads < NUM_KV_HEADS
            value = tl.load(v_ptr + token * stride_v_t + heads * stride_v_h + full_dims, mask=mask)
            if QMAX > 0:
                value, v_scale = quantize_vectors(value.to(tl.float32), QMAX, TO_INT)
                head_ok = tl.arange(0, KV_HEADS_PAD) < NUM_KV_HEADS
                scales_at = v_scale_ptr + scale_offset + tl.arange(0, KV_HEADS_PAD)
                tl.store(scales_at, v_scale.to(v_scale_ptr.dtype.element_ty), mask=head_ok)
            tl.store(
                v_cache_ptr + cache_offset + heads * stride_c_head + full_dims,
                value.to(v_cache_ptr.dtype.element_ty),
                mask=mask,
            )


def apply_rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    kv_write: tuple | None = None,
    kv_scales: tuple | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] in place; cos_sin [P, 2, D] float32.

    kv_write = (v [T, kv_heads, D], k_cache, v_cache, slot_mapping [T]): also store the rotated
    keys and the values in the paged cache ([blocks, tokens_per_block, kv_heads, D] each);
    kv_scales = (k_scales, v_scales) [blocks, tokens_per_block, kv_heads] for a quantized cache,
    which gets what `kv_write.write_kv` stores.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and cos_sin.shape[1:] == (2, head_dim)
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    if kv_write is not None:
        v, k_cache, v_cache, slot_mapping = kv_write
        assert v.shape == k.shape and v.stride(-1) == 1
        assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
        assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(-1) == 1
    else:
        v, k_cache, v_cache, slot_mapping = k, k, k, positions  # unused
    scaled = kv_write is not None and is_scaled(k_cache.dtype)
    if scaled:
        k_scales, v_scales = kv_scales or (None, None)
        check_scales(k_cache, k_scales, v_scales)
    else:
        k_scales = v_scales = slot_mapping  # unused
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q,
            k,
            cos_sin,
            positions,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k_scales,
            v_scales,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin.stride(0),
            cos_sin.stride(1),
            v.stride(0),
            v.stride(1),
            *(k_cache.stride()[:3] if kv_write is not None else (0, 0, 0)),
            *(k_scales.stride()[:2] if scaled else (0, 0)),
            NUM_HEADS=num_heads,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            NUM_KV_HEADS=num_kv_heads,
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2,
            WRITE_KV=kv_write is not None,
            **quantize_rule(k_cache.dtype),
            TOKENS_PER_BLOCK=k_cache.shape[1] if kv_write is not None else 1,
            num_warps=num_warps,
            **launch_options(ORDERING),
        )
    return q, k

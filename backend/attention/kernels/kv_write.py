"""KV-cache write: store the new tokens' keys and values at their cache slots.

One program per token. The token's slot is `block * tokens_per_block + offset`; the program
copies all kv heads of that token (a [kv_heads, head_dim] tile, contiguous along head_dim) into
`cache[block, offset]`, converting to the cache dtype. Slot -1 marks a padded row (CUDA-graph
batches are padded to a captured size) and is skipped.

A quantized cache (fp8 / int8, with k_scales / v_scales [blocks, tokens_per_block, kv_heads])
gets each head vector quantized with its own scale, `backend.attention.kv_dtype`'s rule: the
scale amax / QMAX rounded up to bfloat16, the values x / scale (fp8: to nearest even; int8: half
up). The rule's helpers serve the kernels that write the cache in their own epilogue too (the
rotary kernel, and the decode kernel for the step's own token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.attention.kv_dtype import MIN_SCALE, QMAX, is_scaled

_MIN_SCALE = tl.constexpr(MIN_SCALE)


def quantize_rule(cache_dtype: torch.dtype) -> dict:
    """The rule's constexprs for a cache of `cache_dtype`, as the kernels that write it take them:
    QMAX (0.0: the cache is not quantized) and TO_INT (an int8 cache rounds half up)."""
    scaled = is_scaled(cache_dtype)
    return dict(
        QMAX=QMAX[cache_dtype] if scaled else 0.0,
        TO_INT=scaled and not cache_dtype.is_floating_point,
    )


@triton.jit
def quantize_vectors(x, QMAX: tl.constexpr, TO_INT: tl.constexpr):
    """x [heads, head_dim] float32 -> (x / scale [heads, head_dim] within +-QMAX, rounded half
    up when TO_INT; scale [heads] float32, exact in bfloat16)."""
    scale = vector_scales(tl.max(tl.abs(x), 1), QMAX)
    return quantize_by(x, scale, QMAX, TO_INT), scale


@triton.jit
def vector_scales(amax, QMAX: tl.constexpr):
    """Each vector's largest magnitude [heads] -> its scale: amax / QMAX, rounded up to
    bfloat16 (so the cache's bfloat16 scales hold it exactly)."""
    scale = tl.maximum(tl.math.div_rn(amax, QMAX), _MIN_SCALE)
    bits = scale.to(tl.int32, bitcast=True)
    return ((bits + 0xFFFF) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def quantize_by(x, scale, QMAX: tl.constexpr, TO_INT: tl.constexpr):
    """x [heads, dims] float32 over its heads' scales [heads], within +-QMAX, rounded as the
    cache dtype stores it."""
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if TO_INT:
        y = tl.floor(y + 0.5)
    else:
        y = round_to_e4m3(y)
    return y


@triton.jit
def store_quantized_vector(
    x, cache_ptr, scale_ptr, HEAD_DIM: tl.constexpr, QMAX: tl.constexpr, TO_INT: tl.constexpr
):
    """One head vector x [HEAD_DIM] float32, quantized by the rule above and stored at
    cache_ptr[0:HEAD_DIM], its scale at scale_ptr -> its de-quantized values, as a read of the
    cache gives them."""
    y, scale = quantize_vectors(x[None, :], QMAX, TO_INT)  # [1, HEAD_DIM], [1]
    tl.store(cache_ptr + tl.arange(0, HEAD_DIM)[None, :], y.to(cache_ptr.dtype.element_ty))
    tl.store(scale_ptr + tl.arange(0, 1), scale.to(scale_ptr.dtype.element_ty))
    return tl.reshape(y * scale[:, None], (HEAD_DIM,))


@triton.jit
def round_to_e4m3(y):
    """float32 within +-448 -> the nearest float8 e4m3 value (ties to even), as float32, so the
    cast after it is exact (Triton's interpreter rounds its fp8 casts wrongly at a carry)."""
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1  # the last of the 3 mantissa bits kept
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    # Below 2**-6 (subnormals) the step is 2**-9: adding and taking away 1.5 * 2**23 rounds to it
    subnormal = (y * 512.0 + 12582912.0 - 12582912.0) * 0.001953125
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_head,
    stride_s_block,
    stride_s_offset,
    TOKENS_PER_BLOCK: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QMAX: tl.constexpr = 0.0,
    TO_INT: tl.constexpr = False,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // TOKENS_PER_BLOCK
    offset = slot % TOKENS_PER_BLOCK
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < NUM_KV_HEADS

    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    k_dst = (
        k_cache_ptr
        + block * stride_kc_block
        + offset * stride_kc_offset
        + heads * stride_kc_head
        + dims
    )
    v_dst = (
        v_cache_ptr
        + block * stride_vc_block
        + offset * stride_vc_offset
        + heads * stride_vc_head
        + dims
    )
    if QMAX > 0:  # a quantized cache: values and their scales
        key, k_scale = quantize_vectors(key.to(tl.float32), QMAX, TO_INT)
        value, v_scale = quantize_vectors(value.to(tl.float32), QMAX, TO_INT)
        in_scales = block * stride_s_block + offset * stride_s_offset + tl.arange(0, HEADS_PAD)
        head_ok = tl.arange(0, HEADS_PAD) < NUM_KV_HEADS
        tl.store(k_scale_ptr + in_scales, k_scale.to(k_scale_ptr.dtype.element_ty), mask=head_ok)
        tl.store(v_scale_ptr + in_scales, v_scale.to(v_scale_ptr.dtype.element_ty), mask=head_ok)
    tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """key/value [T, kv_heads, head_dim] -> k_cache/v_cache
    [blocks, tokens_per_block, kv_heads, head_dim] (and their scales, when the cache has them,
    to k_scales/v_scales [blocks, tokens_per_block, kv_heads])."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    scaled = is_scaled(k_cache.dtype)
    if scaled:
        check_scales(k_cache, k_scales, v_scales)
    else:
        k_scales = v_scales = slot_mapping  # unused
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scales,
        v_scales,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *(k_scales.stride()[:2] if scaled else (0, 0)),
        TOKENS_PER_BLOCK=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        **quantize_rule(k_cache.dtype),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )


def check_scales(
    k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None
) -> None:
    """A quantized cache's scales: [blocks, tokens_per_block, kv_heads], kv heads contiguous, K's
    and V's strides alike (the kernels take one set)."""
    assert k_scales is not None and v_scales is not None, "a quantized KV cache needs its scales"
    assert k_scales.shape == v_scales.shape == k_cache.shape[:3]
    assert k_scales.stride() == v_scales.stride() and k_scales.stride(-1) == 1

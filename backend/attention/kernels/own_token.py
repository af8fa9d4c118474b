"""The step's own key and value in the decode kernel (`backend.attention.kernels.decode`): the
last token of a request's context, which the kernel attends apart from the cached key tiles.

Mostly the kernel before wrote them into the cache (the KV write, the rotary kernel or the fused
qkv projection), and they are read back, de-quantized with their scales in a quantized cache.
The one-token path over a quantized cache hands them over unwritten instead (WRITES_NEW_KV): its
fused qkv kernel holds only parts of a head vector, too little to scale it. Then they are
quantized into the cache here by the KV-write rule (`kv_write.store_quantized_vector`), and the
stored values are what the kernel attends, as a later step will read them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backend.attention.kernels.kv_write import store_quantized_vector


@triton.jit
def own_key_value(
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    new_k_ptr,
    new_v_ptr,
    page,
    in_page,
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
    HEAD_DIM: tl.constexpr,
    KV_SCALED: tl.constexpr,
    WRITES_NEW_KV: tl.constexpr,
    QMAX: tl.constexpr,
    TO_INT: tl.constexpr,
):
    """The key and value [HEAD_DIM] float32 of kv head `kv_head` at cache slot (page, in_page);
    with WRITES_NEW_KV taken from row `row` of new_k / new_v and stored there first."""
    dims = tl.arange(0, HEAD_DIM)
    k_slot = k_cache_ptr + page * stride_kc_block + in_page * stride_kc_offset
    v_slot = v_cache_ptr + page * stride_vc_block + in_page * stride_vc_offset
    k_slot += kv_head * stride_kc_head
    v_slot += kv_head * stride_vc_head
    in_scales = page * stride_s_block + in_page * stride_s_offset + kv_head
    if WRITES_NEW_KV:
        new_rows = row * stride_new_t + kv_head * stride_new_h + dims
        k_new = tl.load(new_k_ptr + new_rows).to(tl.float32)
        v_new = tl.load(new_v_ptr + new_rows).to(tl.float32)
        k = store_quantized_vector(k_new, k_slot, k_scale_ptr + in_scales, HEAD_DIM, QMAX, TO_INT)
        v = store_quantized_vector(v_new, v_slot, v_scale_ptr + in_scales, HEAD_DIM, QMAX, TO_INT)
    else:
        k = tl.load(k_slot + dims).to(tl.float32)
        v = tl.load(v_slot + dims).to(tl.float32)
        if KV_SCALED:
            k = k * tl.load(k_scale_ptr + in_scales).to(tl.float32)
            v = v * tl.load(v_scale_ptr + in_scales).to(tl.float32)
    return k, v

"""KV-cache write: store the new tokens' keys and values at their cache slots.

One program per token. The token's slot is `block * tokens_per_block + offset`; the program
copies all kv heads of that token (a [kv_heads, head_dim] tile, contiguous along head_dim) into
`cache[block, offset]`, converting to the cache dtype. Slot -1 marks a padded row (CUDA-graph
batches are padded to a captured size) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
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
    TOKENS_PER_BLOCK: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
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
    tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, kv_heads, head_dim] -> k_cache/v_cache
    [blocks, tokens_per_block, kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
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
        TOKENS_PER_BLOCK=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )

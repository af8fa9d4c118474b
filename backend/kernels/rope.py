"""Rotary position embedding of q and k, in place, in one pass per token.

Llama-style ("rotate half"): for each head with dims split into halves x1 = x[:D/2], x2 = x[D/2:],
    x1' = x1 * cos - x2 * sin,   x2' = x2 * cos + x1 * sin,
with cos/sin of the token's position read from the float32 cache of
`backend.models.rotary.RotaryEmbedding` ([max_positions, 2, D], cos then sin, each the frequency
vector repeated twice, so only its first half is read). One program per token rotates all query
and kv heads; q and k may be strided views into the fused QKV projection output, which is then
updated without copies. Arithmetic is float32 with one rounding to the activation dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(ptr, token, stride_t, stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    first = ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_sin_ptr, positions_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cs_pos, stride_cs_kind,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + position * stride_cs_pos + dims)
    sin = tl.load(cos_sin_ptr + position * stride_cs_pos + stride_cs_kind + dims)
    _rotate_heads(q_ptr, token, stride_q_t, stride_q_h, cos, sin, NUM_HEADS, HEADS_PAD, HALF)
    _rotate_heads(k_ptr, token, stride_k_t, stride_k_h, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] in place; cos_sin [P, 2, D] float32."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and cos_sin.shape[1:] == (2, head_dim)
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q, k, cos_sin, positions,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0), cos_sin.stride(1),
            NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
            NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2, num_warps=4,
        )
    return q, k

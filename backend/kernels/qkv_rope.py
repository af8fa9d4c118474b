"""The one-token qkv projection with rotary embedding and the KV-cache write in its epilogue.

At batch 1 the rotary kernel between the qkv projection and attention is one more launch per
layer for 4 KB of data. Here the projection (`backend.kernels.gemv`'s weight-streaming dot, with
the input RMSNorm as its prologue) computes each program's features in rotary pairs: a program of
BLOCK_N features of a query or key head owns BLOCK_N / 2 dims of the head's first half and the
same dims of its second half, so it can rotate them itself ("rotate half", as
`backend.attention.kernels.rope`), with the cos/sin of the token's position from the float32
cache. Value heads are taken in plain contiguous runs. The rotated keys and the values also go to
the paged cache at the token's slot (slot -1 is skipped), unless no cache is given (a quantized
cache, whose write needs whole head vectors: the decode-attention kernel after it quantizes and
stores them, or `backend.attention.kernels.kv_write`).

Rounding is the unfused path's: the product (plus bias) is rounded to the activation dtype, then
rotated in float32 and rounded again.

Tiles are the GEMV's for the shape and device (`gemv.checked_config`), with at least 8 features
a program (`QKV_BLOCK_N`, where the head size allows): faster than 4 for bf16 rows, and e4m3 rows
keep their table's 16 (benchmarks/README.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.gemv_config import checked_config
from backend.kernels.gemv_stream import stream_rows_dot
from backend.kernels.gemv_weight import StreamedWeight, streamed
from backend.kernels.pdl import Ordering, launch_options

QKV_BLOCK_N = 8
ORDERING = {
    early: Ordering(
        "qkv_rope_gemv",
        releases="before_wait" if early else "after_wait",
        reads_step_inputs_before_wait=True,
    )
    for early in (True, False)
}


@triton.jit
def _qkv_rope_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_w_ptr,
    out_ptr,
    cos_sin_ptr,
    positions_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    K,
    stride_wn,
    eps,
    stride_cs_pos,
    stride_cs_kind,
    stride_c_block,
    stride_c_offset,
    stride_c_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr,
    WRITE_KV: tl.constexpr = True,
    WEIGHT: tl.constexpr = 0,
    scale_ptr=0,
    GROUP: tl.constexpr = 1,
    K_LOOP: tl.constexpr = True,
    exponent_bits=0,
    F16X2: tl.constexpr = False,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    head = tl.program_id(0) // (HEAD_DIM // BLOCK_N)
    part = tl.program_id(0) % (HEAD_DIM // BLOCK_N)
    rotated = head < NUM_HEADS + NUM_KV_HEADS
    lane = tl.arange(0, BLOCK_N)
    # Feature of the head: rotated heads take dims part*PAIRS.. of both halves, values a plain run.
    dim = tl.where(
        rotated, (lane // PAIRS) * HALF + part * PAIRS + lane % PAIRS, part * BLOCK_N + lane
    )
    rows = head.to(tl.int64) * HEAD_DIM + dim
    # Position, cos/sin and slot are step inputs, written before the layers' kernels launch
    # (`backend.kernels.step_inputs`): read them before the wait too.
    position = tl.load(positions_ptr).to(tl.int64)
    half_dim = part * PAIRS + lane % PAIRS
    cos = tl.load(cos_sin_ptr + position * stride_cs_pos + half_dim)
    sin = tl.load(cos_sin_ptr + position * stride_cs_pos + stride_cs_kind + half_dim)
    slot = tl.load(slot_ptr).to(tl.int64)
    acc = stream_rows_dot(
        x_ptr,
        w_ptr,
        norm_w_ptr,
        rows,
        K,
        stride_wn,
        eps,
        PROLOGUE,
        PDL,
        BLOCK_N,
        BLOCK_K,
        PREFETCH_K,
        EARLY_LAUNCH,
        WEIGHT=WEIGHT,
        scale_ptr=scale_ptr,
        GROUP=GROUP,
        K_LOOP=K_LOOP,
        exponent_bits=exponent_bits,
        k_start=0,
        k_end=K,
        F16X2=F16X2,
    )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    if rotated:
        pairs = tl.reshape(y, (2, PAIRS))
        second = tl.arange(0, 2)[:, None] == 1
        x1 = tl.sum(tl.where(second, 0.0, pairs), 0)  # [PAIRS], first-half dims
        x2 = tl.sum(tl.where(second, pairs, 0.0), 0)  # the same dims of the second half
        is_second = lane >= PAIRS
        partner = tl.reshape(tl.where(second, x1[None, :], x2[None, :]), (BLOCK_N,))
        y = tl.where(is_second, y * cos + partner * sin, y * cos - partner * sin)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows, y)
    if WRITE_KV & (head >= NUM_HEADS) & (slot >= 0):
        in_cache = (slot // CACHE_BLOCK) * stride_c_block + (slot % CACHE_BLOCK) * stride_c_offset
        if rotated:
            kv_head = head - NUM_HEADS
            tl.store(
                k_cache_ptr + in_cache + kv_head * stride_c_head + dim,
                y.to(k_cache_ptr.dtype.element_ty),
            )
        else:
            kv_head = head - NUM_HEADS - NUM_KV_HEADS
            tl.store(
                v_cache_ptr + in_cache + kv_head * stride_c_head + dim,
                y.to(v_cache_ptr.dtype.element_ty),
            )


def qkv_rope_gemv(
    x: torch.Tensor,
    weight: torch.Tensor | StreamedWeight,
    bias: torch.Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    config: dict | None = None,
) -> torch.Tensor:
    """x [1, hidden], weight [(heads + 2 kv_heads) * D, hidden] -> qkv [1, (heads + 2 kv_heads) * D]
    with q and k rotated for `positions` [1]; the rotated keys and the values are also stored at
    `slot_mapping` [1] in k_cache / v_cache ([blocks, tokens_per_block, kv_heads, D]; None: not).
    `norm_weight`/`eps`: RMSNorm x first. cos_sin [P, 2, D] float32 (`RotaryEmbedding.cos_sin`).
    A quantized `weight` (`StreamedWeight`) is de-quantized as it streams."""
    weight = streamed(weight)
    values = weight.values
    n, k = weight.shape
    head_dim = cos_sin.shape[-1]
    assert x.shape == (1, k) and x.stride(-1) == 1 and values.stride(-1) == 1 and weight.takes(x)
    assert n == (num_heads + 2 * num_kv_heads) * head_dim and cos_sin.stride(-1) == 1
    assert positions.numel() == 1 and slot_mapping.numel() == 1
    write_kv = k_cache is not None
    if write_kv:
        assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
        assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(-1) == 1
    tuned = checked_config(n, k, None, device=values.device, weight_format=weight.format)
    # At least QKV_BLOCK_N features a program, in whole rotary pairs of one head.
    widths = (max(QKV_BLOCK_N, tuned["BLOCK_N"]), QKV_BLOCK_N)
    tile = next(({"BLOCK_N": w} for w in widths if (head_dim // 2) % (w // 2) == 0), {})
    config = checked_config(
        n, k, {**tile, **(config or {})}, device=values.device, weight_format=weight.format
    )
    config = {key: value for key, value in config.items() if key != "SPLIT"}  # K is not split
    assert config["BLOCK_N"] >= 2 and (head_dim // 2) % (config["BLOCK_N"] // 2) == 0, (
        "a program's features must be whole rotary pairs within one head"
    )
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _qkv_rope_kernel[(n // config["BLOCK_N"],)](
        x,
        weight.kernel_values,
        bias if bias is not None else values,
        norm_weight if norm_weight is not None else values,
        out,
        cos_sin,
        positions,
        slot_mapping,
        k_cache if write_kv else out,
        v_cache if write_kv else out,
        k,
        values.stride(0),
        eps,
        cos_sin.stride(0),
        cos_sin.stride(1),
        *(k_cache.stride()[:3] if write_kv else (0, 0, 0)),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        CACHE_BLOCK=k_cache.shape[1] if write_kv else 1,
        PROLOGUE=1 if norm_weight is not None else 0,
        HAS_BIAS=bias is not None,
        WRITE_KV=write_kv,
        K_LOOP=config["PREFETCH_K"] < k,
        **weight.kernel_args(),
        **config,
        **launch_options(ORDERING[config["EARLY_LAUNCH"]]),
    )
    return out

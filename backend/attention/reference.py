"""Plain-torch paged attention: the ground truth in tests and the CPU path.

Causal attention with grouped-query heads, reading every key and value from the paged cache.
With `window` (sliding-window attention) a query at position q sees key k <= q only when
q - k < window - sinks or k < sinks: the first `sinks` tokens and the last window - sinks ones
(positions are the original ones; blocks outside the window may be gone, their table entries
point anywhere, and are never read into a result).

Scores are q.k * scale, then, with `softcap`, softcap * tanh(scores / softcap) (Gemma 2).

A quantized cache (`kv_dtype.py`: fp8 or int8 values) comes with `k_scales` / `v_scales`
[blocks, tokens_per_block, kv_heads]: keys and values are stored quantized and read back as
value * scale, in float32.
"""

from __future__ import annotations

import torch

from backend.attention import kv_dtype
from backend.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their cache slots (quantized,
    with their scales, when the cache has scales)."""
    for new, cache, scales in ((key, k_cache, k_scales), (value, v_cache, v_scales)):
        slots = cache.view(-1, *cache.shape[2:])  # [blocks * tokens_per_block, kv_heads, D]
        if scales is None:
            slots[slot_mapping] = new.to(cache.dtype)
        else:  # one-byte values, moved as bytes (indexing has no float8 kernels everywhere)
            values, vector_scales = kv_dtype.quantize(new, cache.dtype)
            slots.view(torch.uint8)[slot_mapping] = values.view(torch.uint8)
            scales.view(-1, scales.shape[-1])[slot_mapping] = vector_scales


def _read(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """The float32 keys or values of `blocks` (any index shape), de-quantized."""
    if scales is None:
        return cache[blocks].float()
    values = cache.view(torch.uint8)[blocks].view(cache.dtype)
    return kv_dtype.dequantize(values, scales[blocks])


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: int = 0,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, heads, head_dim] -> output [T, heads, head_dim]."""
    if meta.is_decode_only and meta.num_seqs > 1:
        return _decode_batched(
            query, k_cache, v_cache, meta, scale, window, sinks, softcap, k_scales, v_scales
        )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    tokens_per_block = k_cache.shape[1]
    out = torch.empty_like(query)
    start = 0
    for b, (q_len, ctx_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        num_blocks = (ctx_len + tokens_per_block - 1) // tokens_per_block
        blocks = meta.block_tables[b, :num_blocks].long()
        keys = _read(k_cache, k_scales, blocks).reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        values = _read(v_cache, v_scales, blocks).reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        q = query[start : start + q_len].float()  # [q, H, D]
        k = keys.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = values.repeat_interleave(group, dim=1)
        scores = _capped(torch.einsum("qhd,khd->hqk", q, k) * scale, softcap)
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        k_pos = torch.arange(ctx_len, device=query.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if window is not None:
            hidden |= _outside_window(q_pos[:, None], k_pos[None, :], window, sinks)
            v = v.masked_fill(hidden.all(0)[:, None, None], 0.0)  # freed blocks: any content
        scores.masked_fill_(hidden[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        start += q_len
    return out


def _decode_batched(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: int = 0,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode-only batches (one query row per request, in request order) in a few batched ops
    instead of a loop over requests: gather every context, padded to the longest, and mask.
    The same arithmetic as the loop above, so the two agree to float rounding."""
    num_seqs = meta.num_seqs
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, tokens_per_block = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    longest = meta.max_seq_len
    tables = meta.block_tables[:, : (longest + tokens_per_block - 1) // tokens_per_block].long()
    keys = _read(k_cache, k_scales, tables).reshape(num_seqs, -1, num_kv_heads, head_dim)
    values = _read(v_cache, v_scales, tables).reshape(num_seqs, -1, num_kv_heads, head_dim)
    keys, values = keys[:, :longest], values[:, :longest]
    padding = (
        torch.arange(longest, device=query.device)[None, :] >= meta.seq_lens[:, None]
    )  # [B, L]
    if window is not None:
        k_pos = torch.arange(longest, device=query.device)[None, :]
        padding |= _outside_window(meta.seq_lens[:, None] - 1, k_pos, window, sinks)
    values = values.masked_fill(padding[:, :, None, None], 0.0)  # unwritten slots may hold NaN
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = _capped(torch.einsum("bkgd,blkd->bkgl", q, keys) * scale, softcap)
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _outside_window(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sinks: int
) -> torch.Tensor:
    """Keys (at or before the query) that a windowed query does not see."""
    return (q_pos - k_pos >= window - sinks) & (k_pos >= sinks)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap

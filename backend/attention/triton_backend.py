"""Triton-language paged attention: the GPU twin of `backend.attention.reference`.

Same two functions, same tensors:
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    paged_attention(query, k_cache, v_cache, meta, scale, window=None, sinks=0) -> out
and `decode_partials`, split-K decode attention with the splits left for the consumer to merge.
`paged_attention` sends decode-only batches (every request has one query token) to the split-K
decode kernel and every other batch (prefill chunks, possibly mixed with decodes) to the prefill
kernel. Only the ints meta.max_query_len / meta.max_seq_len are read on the host, to pick the
kernel and size the grid; everything else stays on the device.
"""

from __future__ import annotations

import torch

from backend.attention.kernels.decode import (
    READ_MERGE_MAX_SPLITS,
    decode_attention,
    decode_attention_partials,
)
from backend.attention.kernels.kv_write import write_kv
from backend.attention.kernels.prefill import prefill_attention
from backend.attention.metadata import AttentionMetadata
from backend.kernels.split_partials import SplitPartials

__all__ = ["write_kv", "paged_attention", "decode_partials"]


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
    """query [T, heads, head_dim] -> output [T, heads, head_dim] (causal, GQA, paged K/V;
    sliding-window with sinks when `window` is set); scores tanh soft-capped at `softcap` when
    given; `k_scales`/`v_scales`: a quantized cache's scales (backend.attention.kv_dtype)."""
    mixed = meta.max_query_len > 1
    # In a mixed step the decode kernel attends the requests of one row (a prefill tile would
    # spend a whole tile of rows on each), the prefill kernel the others.
    out = decode_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        _keys_read(meta, window),
        scale,
        window=window,
        sinks=sinks,
        softcap=softcap,
        k_scales=k_scales,
        v_scales=v_scales,
        single_rows_only=mixed,
    )
    if not mixed:
        return out
    return prefill_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        out=out,
        window=window,
        sinks=sinks,
        softcap=softcap,
        k_scales=k_scales,
        v_scales=v_scales,
        single_rows_elsewhere=True,
    )


def decode_partials(
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
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SplitPartials:
    """Decode-only steps: query [T, heads, head_dim] -> each split's output and log-sum-exp,
    unmerged (the one-token o projection merges them as it reads them). `new_kv`: the step's own
    keys and values, which the kernel writes into a quantized cache itself. Splits past
    READ_MERGE_MAX_SPLITS never weigh (the kernel merged them), so the consumer reads no further."""
    outputs, lse = decode_attention_partials(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        _keys_read(meta, window),
        scale,
        window=window,
        sinks=sinks,
        softcap=softcap,
        k_scales=k_scales,
        v_scales=v_scales,
        new_kv=new_kv,
    )
    return SplitPartials(outputs, lse, min(outputs.shape[2], READ_MERGE_MAX_SPLITS))


def _keys_read(meta: AttentionMetadata, window: int | None) -> int:
    """The most keys a decode query reads (sizes the split-K heuristic)."""
    return meta.max_seq_len if window is None else min(meta.max_seq_len, window)

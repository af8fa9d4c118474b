"""The torch reference's batched decode path equals its per-request path, whatever the garbage in
unwritten cache slots (the CPU cache is allocated uninitialised)."""

from __future__ import annotations

import pytest
import torch

from backend.attention.metadata import AttentionMetadata
from backend.attention.reference import paged_attention


def metadata(seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_batched_decode_equals_per_request(heads, kv_heads):
    torch.manual_seed(0)
    block, head_dim, seq_lens = 4, 16, [1, 7, 12, 5]
    k_cache = torch.full((24, block, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(24).tolist()
    tables = []
    for n in seq_lens:
        blocks = [order.pop() for _ in range(-(-n // block))]
        tables.append(blocks)
        for i, b in enumerate(blocks):  # write only the slots the request owns
            used = min(block, n - i * block)
            k_cache[b, :used] = torch.randn(used, kv_heads, head_dim)
            v_cache[b, :used] = torch.randn(used, kv_heads, head_dim)
    query = torch.randn(len(seq_lens), heads, head_dim)
    batched = paged_attention(query, k_cache, v_cache, metadata(seq_lens, tables), 0.25)
    for b, (n, table) in enumerate(zip(seq_lens, tables)):
        alone = paged_attention(query[b : b + 1], k_cache, v_cache, metadata([n], [table]), 0.25)
        torch.testing.assert_close(batched[b : b + 1], alone, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(batched).all()

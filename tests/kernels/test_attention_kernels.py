"""Triton attention kernels against the torch reference.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), so shapes stay small; with a GPU the same tests run the compiled kernels.
Caches start filled with NaN and only real context tokens are written, so any read of a stale
slot (past a partial last block, or through a padded block-table entry) shows up as NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.attention import (
    reference,  # noqa: E402
    triton_backend,  # noqa: E402
)
from backend.attention.kernels import decode, decode_launch  # noqa: E402
from backend.attention.kernels.decode import decode_attention  # noqa: E402
from backend.attention.kernels.decode_launch import choose_num_splits  # noqa: E402
from backend.attention.kernels.prefill import prefill_attention  # noqa: E402
from backend.attention.metadata import AttentionMetadata  # noqa: E402

ATOL = 1e-4
pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    # The interpreter itself trips a numpy deprecation on every scalar it indexes with.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]


def make_batch(
    query_lens,
    seq_lens,
    *,
    num_kv_heads,
    head_dim,
    tokens_per_block,
    dtype=torch.float32,
    seed=0,
    spare_blocks=3,
):
    """A paged cache holding every request's full context, and the step's metadata.

    Physical blocks are handed out in shuffled order from a pool with `spare_blocks` nobody owns;
    slots that hold no token stay NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / tokens_per_block) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq + [1])
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    new_slots = []
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        table = [physical.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots = torch.tensor(
            [
                table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
                for p in range(s_len)
            ],
            dtype=torch.int64,
        )
        keys = torch.randn(s_len, num_kv_heads, head_dim, generator=gen)
        values = torch.randn(s_len, num_kv_heads, head_dim, generator=gen)
        reference.write_kv(keys, values, k_cache, v_cache, slots)
        new_slots.append(slots[s_len - q_len :])
    query_start = [0]
    for q_len in query_lens:
        query_start.append(query_start[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots).to(DEVICE),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return k_cache.to(DEVICE), v_cache.to(DEVICE), meta


def random_query(num_tokens, num_heads, head_dim, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, dtype)


def assert_matches_reference(out, query, k_cache, v_cache, meta, scale, atol=ATOL, softcap=None):
    expected = reference.paged_attention(
        query.cpu().float(),
        k_cache.cpu().float(),
        v_cache.cpu().float(),
        meta_on_cpu(meta),
        scale,
        softcap=softcap,
    )
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().float(), expected, atol=atol, rtol=0)


def meta_on_cpu(meta):
    return AttentionMetadata(
        meta.slot_mapping.cpu(),
        meta.query_start_loc.cpu(),
        meta.seq_lens.cpu(),
        meta.block_tables.cpu(),
        meta.max_query_len,
        meta.max_seq_len,
        meta.query_lens_cpu,
        meta.seq_lens_cpu,
    )


# ---------------------------------------------------------------------------------------------
# KV write


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,tokens_per_block", [(2, 32, 16), (3, 64, 32), (8, 32, 16)]
)
def test_write_kv_matches_reference_and_skips_padding(num_kv_heads, head_dim, tokens_per_block):
    torch.manual_seed(0)
    num_blocks, num_tokens = 6, 11
    # key/value as strided views of one packed tensor, the way they come out of a fused QKV.
    packed = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, device=DEVICE)
    key, value = packed[:, :num_kv_heads], packed[:, num_kv_heads : 2 * num_kv_heads]
    slots = torch.randperm(num_blocks * tokens_per_block)[:num_tokens].to(DEVICE)
    slots[[2, 7]] = -1
    k_cache = torch.randn(num_blocks, tokens_per_block, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    reference.write_kv(key[keep], value[keep], k_expected, v_expected, slots[keep])

    triton_backend.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_write_kv_converts_to_cache_dtype():
    key = torch.randn(5, 2, 32, device=DEVICE)
    value = torch.randn(5, 2, 32, device=DEVICE)
    k_cache = torch.zeros(2, 16, 2, 32, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, -1, 0, 31], device=DEVICE)
    triton_backend.write_kv(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, 2, 32)
    assert torch.equal(flat_k[slots[[0, 1, 3, 4]]], key[[0, 1, 3, 4]].half())
    assert torch.equal(v_cache.view(-1, 2, 32)[17], value[1].half())


# ---------------------------------------------------------------------------------------------
# Decode (one query token per request)

# One token, exactly one block, partial blocks, several blocks; the cached context (all but the
# step's own token) exactly one 64-key tile, one tile and one key, one 128-key tile, one 128-key
# tile and one key, several tiles of either size.
DECODE_SEQ_LENS = [1, 16, 23, 70, 65, 66, 129, 130, 300]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("tokens_per_block", [16, 32])
@pytest.mark.parametrize("num_splits,min_tiles_per_split", [(1, 2), (3, 1), (3, 2), (8, 1)])
@pytest.mark.parametrize("sms", [1, 10000], ids=["64-key tiles", "128-key tiles"])
def test_decode_matches_reference(
    num_heads, num_kv_heads, tokens_per_block, num_splits, min_tiles_per_split, sms, monkeypatch
):
    """Grids of few (request, kv head) pairs for the SMs take 128-key tiles, others 64."""
    monkeypatch.setattr(decode_launch, "num_sms", lambda device: sms)
    head_dim = 32
    n = len(DECODE_SEQ_LENS)
    k_cache, v_cache, meta = make_batch(
        [1] * n,
        DECODE_SEQ_LENS,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tokens_per_block=tokens_per_block,
    )
    query = random_query(n, num_heads, head_dim)
    scale = head_dim**-0.5
    out = decode_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len,
        scale,
        num_splits=num_splits,
        min_tiles_per_split=min_tiles_per_split,
    )
    assert_matches_reference(out, query, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("tokens_per_block,block_n", [(16, 16), (32, 16), (32, 32)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_tiles_within_one_page_match_reference(
    tokens_per_block, block_n, num_splits, monkeypatch
):
    """Where the key tile divides the page, each tile reads one page number (tile.py): the
    tiles of every request, split or not, still read their own pages."""
    config = dict(BLOCK_N=block_n, num_warps=2, num_stages=1)
    monkeypatch.setattr(decode_launch, "launch_config", lambda *args: config)
    n = len(DECODE_SEQ_LENS)
    k_cache, v_cache, meta = make_batch(
        [1] * n, DECODE_SEQ_LENS, num_kv_heads=2, head_dim=32, tokens_per_block=tokens_per_block
    )
    query = random_query(n, 4, 32)
    out = decode_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len,
        0.2,
        num_splits=num_splits,
    )
    assert_matches_reference(out, query, k_cache, v_cache, meta, 0.2)


@pytest.mark.parametrize("most_values", [8192, 0], ids=["group at once", "head by head"])
def test_decode_split_merge_leaves_its_counters_at_zero(most_values, monkeypatch):
    """The last split of a request to finish merges the partial results (all the group's heads at
    once while they are few, else head by head) and resets its arrival counter, so the next
    launch (a CUDA graph replay reuses the same counters) merges again."""
    from backend.kernels.arrivals import arrival_counters

    monkeypatch.setattr(decode, "MERGE_AT_ONCE_MAX_VALUES", most_values)
    k_cache, v_cache, meta = make_batch(
        [1] * 3, [300, 130, 1], num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=7
    )
    query = random_query(3, 4, 32, seed=8)
    runs = [
        decode_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_seq_len,
            0.3,
            num_splits=4,
            min_tiles_per_split=1,
        )
        for _ in range(3)
    ]
    assert not arrival_counters("decode_attention", query.device, 6).any()
    assert_matches_reference(runs[0], query, k_cache, v_cache, meta, 0.3)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 8, 2), (128, 4, 1), (256, 4, 1)])
def test_decode_head_dims_through_dispatch(head_dim, num_heads, num_kv_heads):
    k_cache, v_cache, meta = make_batch(
        [1] * 3,
        [5, 33, 64],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tokens_per_block=16,
        seed=3,
    )
    query = random_query(3, num_heads, head_dim, seed=4)
    out = triton_backend.paged_attention(query, k_cache, v_cache, meta, head_dim**-0.5)
    assert_matches_reference(out, query, k_cache, v_cache, meta, head_dim**-0.5)


def test_decode_more_splits_than_key_tiles_and_padding_row():
    """Empty splits contribute nothing; a padding row (seq_len 0) yields zeros, not NaN."""
    k_cache, v_cache, meta = make_batch(
        [1, 1], [3, 40], num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=5
    )
    query = random_query(3, 4, 32, seed=6)
    seq_lens = torch.tensor([3, 40, 0], dtype=torch.int32, device=DEVICE)
    query_start = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    block_tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])
    out = decode_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start, 40, 0.2, num_splits=8
    )
    assert_matches_reference(out[:2], query[:2], k_cache, v_cache, meta, 0.2)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def merge_partials(part_out, part_lse):
    """The merge the partials' consumer does, in torch: [requests, heads, splits, D] -> [.., D]."""
    top = part_lse.max(-1, keepdim=True).values
    weight = torch.exp2(part_lse - torch.where(torch.isinf(top), 0.0, top))
    total = weight.sum(-1)
    summed = torch.where(weight[..., None] > 0, part_out * weight[..., None], 0.0).sum(-2)
    return summed / torch.where(total > 0, total, 1.0)[..., None]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("sms", [1, 10000], ids=["64-key tiles", "128-key tiles"])
def test_decode_partials_merge_to_the_reference(num_splits, sms, monkeypatch):
    """Unmerged splits: merged as their consumer merges them, they give the reference output;
    splits a request does not use (and every split of a padding row) weigh nothing."""
    monkeypatch.setattr(decode_launch, "num_sms", lambda device: sms)
    n = len(DECODE_SEQ_LENS)
    k_cache, v_cache, meta = make_batch(
        [1] * n, DECODE_SEQ_LENS, num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=9
    )
    query = random_query(n + 1, 4, 32, seed=10)
    seq_lens = torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    query_start = torch.arange(n + 2, dtype=torch.int32, device=DEVICE)
    block_tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])
    for _ in range(2):  # the second launch finds the first one's partials in the buffers
        part_out, part_lse = decode.decode_attention_partials(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start,
            meta.max_seq_len,
            0.3,
            num_splits=num_splits,
        )
        assert part_out.shape == (n + 1, 4, num_splits, 32) and part_lse.shape == (
            n + 1,
            4,
            num_splits,
        )
        merged = merge_partials(part_out.cpu(), part_lse.cpu())
        assert_matches_reference(merged[:n], query[:n], k_cache, v_cache, meta, 0.3)
        assert torch.equal(merged[n], torch.zeros_like(merged[n]))
        assert torch.isinf(part_lse[n]).all()  # the padding row: no keys anywhere
    if num_splits == 8:  # a 1-token context has no cached tiles: one split, the rest unused
        assert torch.isfinite(part_lse[0, :, 0]).all() and torch.isinf(part_lse[0, :, 1:]).all()


LONG_SEQ_LENS = [3000, 200, 1]


@pytest.mark.parametrize("partials", [True, False], ids=["partials", "merged"])
def test_long_contexts_cost_their_own_splits_whatever_the_split_ceiling(partials, monkeypatch):
    """A decode graph's split count comes from the capacity (the longest context it may see), not
    from the step. Launched with that ceiling (64), a 3,000-token context, its blocks scattered
    over a pool five times its size, gives the reference output and the same output as a launch
    sized from the step's own lengths; its partials reach the o projection already merged (one
    split of weight, so each of that projection's programs reads one), while a 200-token context
    leaves its few splits (at most READ_MERGE_MAX_SPLITS) to be merged as they are read."""
    monkeypatch.setattr(decode_launch, "num_sms", lambda device: 16)  # 64-key tiles, 8 splits
    k_cache, v_cache, meta = make_batch(
        [1] * 3,
        LONG_SEQ_LENS,
        num_kv_heads=2,
        head_dim=32,
        tokens_per_block=16,
        seed=11,
        spare_blocks=4 * math.ceil(3000 / 16),
    )
    query = random_query(3, 4, 32, seed=12)
    step_splits = decode_launch.splits_for(
        decode_launch.config_for(query, k_cache, 3), query, k_cache, 3, max(LONG_SEQ_LENS)
    )
    assert step_splits == 8
    args = (query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    outs = []
    for num_splits in (64, step_splits):
        if partials:
            part_out, part_lse = decode.decode_attention_partials(
                *args, meta.max_seq_len, 0.3, num_splits=num_splits
            )
            outs.append(merge_partials(part_out.cpu(), part_lse.cpu()))
            weighed = torch.isfinite(part_lse.cpu()).sum(-1)  # splits of weight, per head
            assert (weighed[0] == 1).all()  # 47 tiles: merged here
            assert (weighed[1] <= decode.READ_MERGE_MAX_SPLITS).all() and (weighed[1] > 1).all()
            assert (weighed[2] == 1).all()
        else:
            outs.append(decode_attention(*args, meta.max_seq_len, 0.3, num_splits=num_splits))
        assert_matches_reference(outs[-1], query, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(outs[0].cpu(), outs[1].cpu(), atol=1e-5, rtol=0)


def test_the_split_count_is_sized_from_the_lengths_it_is_given():
    """Eager steps size their grid from the step's longest context (`meta.max_seq_len`, what
    `_keys_read` hands the kernel), not from the engine's max_seq_len; a window caps it."""
    k_cache, v_cache, meta = make_batch(
        [1], [200], num_kv_heads=8, head_dim=32, tokens_per_block=16, seed=2
    )
    assert meta.max_seq_len == 200
    assert triton_backend._keys_read(meta, None) == 200
    assert triton_backend._keys_read(meta, 128) == 128
    assert choose_num_splits(1, 8, 200, 132) == 2  # not the 64 a 131,072-token capacity gives
    assert choose_num_splits(1, 8, 131072, 132) == 64


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 4096, 132) == 1  # big batch already fills the GPU
    assert choose_num_splits(1, 8, 100, 132) == 1  # short context: nothing to split
    assert choose_num_splits(1, 8, 1024, 132) == 16  # 64 tokens per split at least
    assert choose_num_splits(1, 8, 8192, 132) == 64  # 8 programs -> 512, capped at 64
    assert choose_num_splits(4, 8, 1024, 132) == 16
    assert choose_num_splits(32, 8, 1024, 132) == 2  # rounded down to a power of two
    assert choose_num_splits(64, 8, 2048, 132) == 1  # 512 programs: close enough to 528
    # a config of 8 programs an SM (registers capped) fills 1,056 programs
    assert choose_num_splits(64, 8, 2048, 132, programs_per_sm=8) == 2
    assert choose_num_splits(128, 8, 2048, 132, programs_per_sm=8) == 1


def test_programs_per_sm_follow_a_register_cap():
    assert decode_launch.programs_per_sm(dict(BLOCK_N=64, num_warps=2, num_stages=1)) == 4
    capped = dict(BLOCK_N=32, num_warps=2, num_stages=1, maxnreg=128)
    assert decode_launch.programs_per_sm(capped) == 8  # 65,536 / (128 x 64 threads)
    assert decode_launch.programs_per_sm(dict(capped, num_warps=4, maxnreg=96)) == 5


@pytest.mark.parametrize("maxnreg,splits", [(None, 1), (128, 2)])
def test_the_split_count_counts_the_programs_an_sm_holds(maxnreg, splits, monkeypatch):
    """With 10 SMs, 8 requests x 5 kv heads (40 programs) fill 4 an SM but not 8: a config that
    caps registers so that 8 fit takes 2 splits, and still matches the reference."""
    monkeypatch.setattr(decode_launch, "num_sms", lambda device: 10)
    config = dict(BLOCK_N=32, num_warps=2, num_stages=1) | ({"maxnreg": maxnreg} if maxnreg else {})
    monkeypatch.setattr(decode_launch, "launch_config", lambda *args: config)
    k_cache, v_cache, meta = make_batch(
        [1] * 8, [300] * 8, num_kv_heads=5, head_dim=32, tokens_per_block=16
    )
    query = random_query(8, 10, 32)
    part_out, part_lse = decode.decode_attention_partials(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len,
        0.3,
    )
    assert part_out.shape[2] == splits
    merged = merge_partials(part_out.cpu(), part_lse.cpu())
    assert_matches_reference(merged, query, k_cache, v_cache, meta, 0.3)


# ---------------------------------------------------------------------------------------------
# Prefill over a paged prefix (variable lengths, mixed with decodes)

# (query_lens, seq_lens): first chunks (q == s), later chunks/prefix hits (q < s), decodes (q == 1)
MIXED_BATCH = ([1, 7, 37, 3, 20, 1], [9, 7, 70, 50, 20, 1])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("tokens_per_block", [16, 32])
def test_prefill_mixed_batch_matches_reference(num_heads, num_kv_heads, tokens_per_block):
    head_dim = 32
    query_lens, seq_lens = MIXED_BATCH
    k_cache, v_cache, meta = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tokens_per_block=tokens_per_block,
        seed=7,
    )
    query = random_query(sum(query_lens), num_heads, head_dim, seed=8)
    scale = head_dim**-0.5
    out = triton_backend.paged_attention(query, k_cache, v_cache, meta, scale)
    assert_matches_reference(out, query, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_mixed_step_splits_its_rows_between_the_two_kernels(num_splits):
    """A mixed step's requests of one row go to the decode kernel and the others to the prefill
    kernel: each leaves the other's rows as they were, and together they are the reference."""
    from backend.kernels.arrivals import arrival_counters

    query_lens, seq_lens = MIXED_BATCH
    k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=9
    )
    query = random_query(sum(query_lens), 8, 32, seed=10)
    args = (query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    single = torch.tensor([q == 1 for q in query_lens for _ in range(q)], device=DEVICE)
    decoded = torch.full_like(query, float("nan"))
    decode_attention(*args, max(seq_lens), 0.2, num_splits, out=decoded, single_rows_only=True)
    assert decoded[~single].isnan().all() and not decoded[single].isnan().any()
    prefilled = torch.full_like(query, float("nan"))
    prefill_attention(*args, 0.2, out=prefilled, single_rows_elsewhere=True)
    assert prefilled[single].isnan().all() and not prefilled[~single].isnan().any()
    both = torch.where(single[:, None, None], decoded, prefilled)
    assert_matches_reference(both, query, k_cache, v_cache, meta, 0.2)
    assert not arrival_counters("decode_attention", query.device, 12).any()


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 32), (16, 64)])
def test_prefill_small_tiles_cross_pages_and_diagonal(block_m, block_n):
    """Small tiles: many query tiles per request, key tiles spanning several pages."""
    query_lens, seq_lens = [33, 1, 0, 18], [33, 45, 12, 61]  # includes an idle request (q_len 0)
    k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=9
    )
    query = random_query(sum(query_lens), 4, 32, seed=10)
    out = prefill_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        0.25,
        block_m=block_m,
        block_n=block_n,
    )
    assert_matches_reference(out, query, k_cache, v_cache, meta, 0.25)


@pytest.mark.parametrize("head_dim", [64, 128, 256])  # 256: Gemma
def test_prefill_head_dims(head_dim):
    query_lens, seq_lens = [12, 1, 30], [40, 17, 30]
    k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_kv_heads=1, head_dim=head_dim, tokens_per_block=16, seed=11
    )
    query = random_query(sum(query_lens), 2, head_dim, seed=12)
    out = triton_backend.paged_attention(query, k_cache, v_cache, meta, head_dim**-0.5)
    assert_matches_reference(out, query, k_cache, v_cache, meta, head_dim**-0.5)


def test_prefill_handles_strided_query():
    """query as a view into a packed QKV tensor (row stride larger than heads * head_dim)."""
    query_lens, seq_lens = [5, 9], [21, 9]
    k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=13
    )
    packed = random_query(sum(query_lens), 8, 32, seed=14)
    query = packed[:, :4]
    out = triton_backend.paged_attention(query, k_cache, v_cache, meta, 0.2)
    assert_matches_reference(out, query, k_cache, v_cache, meta, 0.2)


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1], [20, 45]), ([6, 1], [6, 30])])
def test_half_precision_cache(query_lens, seq_lens):
    """fp16 cache and query (bf16 is the GPU dtype; fp16 runs everywhere): fp32 accumulation."""
    k_cache, v_cache, meta = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=2,
        head_dim=32,
        tokens_per_block=16,
        dtype=torch.float16,
        seed=15,
    )
    query = random_query(sum(query_lens), 4, 32, dtype=torch.float16, seed=16)
    out = triton_backend.paged_attention(query, k_cache, v_cache, meta, 32**-0.5)
    assert out.dtype == torch.float16
    assert_matches_reference(out, query, k_cache, v_cache, meta, 32**-0.5, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# Sliding window and attention sinks


def free_outside_window(meta, k_cache, window, sinks):
    """Point every block wholly outside the window of all of a request's queries (and past its
    sinks) at a block of NaN, as if it went back to the pool: the kernels must not read it."""
    tokens_per_block = k_cache.shape[1]
    unowned = torch.isnan(k_cache.cpu()).flatten(1).all(1)  # make_batch leaves a few (NaN)
    nan_block = int(unowned.nonzero()[0])
    tables = meta.block_tables.cpu().clone()
    for b, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        first_visible = s_len - q_len - (window - sinks) + 1  # of the chunk's first query
        for i in range(tables.shape[1]):
            if i * tokens_per_block >= sinks and (i + 1) * tokens_per_block <= first_visible:
                tables[b, i] = nan_block
    meta.block_tables = tables.to(DEVICE)
    return meta


def windowed_reference(query, k_cache, v_cache, meta, scale, window, sinks):
    return reference.paged_attention(
        query.cpu().float(),
        k_cache.cpu().float(),
        v_cache.cpu().float(),
        meta_on_cpu(meta),
        scale,
        window=window,
        sinks=sinks,
    )


@pytest.mark.parametrize("sinks", [0, 4, 20])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_window_512(sinks, num_splits):
    """Contexts shorter than, equal to, one past and well past the window; sinks inside one
    key tile and across a block boundary; windowed blocks freed."""
    window, seq_lens = 512, [700, 513, 512, 514, 300, 1]
    k_cache, v_cache, meta = make_batch(
        [1] * len(seq_lens), seq_lens, num_kv_heads=1, head_dim=16, tokens_per_block=16, seed=21
    )
    meta = free_outside_window(meta, k_cache, window, sinks)
    query = random_query(len(seq_lens), 2, 16, seed=22)
    out = decode_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len,
        0.25,
        num_splits=num_splits,
        window=window,
        sinks=sinks,
    )
    expected = windowed_reference(query, k_cache, v_cache, meta, 0.25, window, sinks)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_m,block_n,sinks", [(64, 64, 0), (64, 64, 4), (16, 32, 4)])
def test_prefill_window_512_across_chunks(block_m, block_n, sinks):
    """A first chunk longer than the window, later chunks that cross it, a decode row; key tiles
    spanning pages; freed blocks hold NaN."""
    window = 512
    query_lens, seq_lens = [700, 90, 1, 37], [700, 650, 600, 530]
    k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_kv_heads=1, head_dim=16, tokens_per_block=16, seed=23
    )
    meta = free_outside_window(meta, k_cache, window, sinks)
    query = random_query(sum(query_lens), 2, 16, seed=24)
    out = prefill_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        0.25,
        block_m=block_m,
        block_n=block_n,
        window=window,
        sinks=sinks,
    )
    expected = windowed_reference(query, k_cache, v_cache, meta, 0.25, window, sinks)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=0)


def test_window_4096_short_context_unchanged_long_context_masked():
    """A window of 4096: a context within it attends exactly as global attention does; a decode
    and a chunk 40 tokens past it do not, and equal the windowed reference."""
    window = 4096
    short = make_batch([1, 30], [300, 300], num_kv_heads=1, head_dim=16, tokens_per_block=32)
    query = random_query(31, 2, 16, seed=26)
    global_out = triton_backend.paged_attention(query, *short, 0.25)
    windowed = triton_backend.paged_attention(query, *short, 0.25, window=window)
    assert torch.equal(windowed, global_out)

    for query_lens in ([1, 1], [1, 40]):
        k_cache, v_cache, meta = make_batch(
            query_lens, [4136, 4097], num_kv_heads=1, head_dim=16, tokens_per_block=32, seed=27
        )
        meta = free_outside_window(meta, k_cache, window, 0)
        query = random_query(sum(query_lens), 2, 16, seed=28)
        out = triton_backend.paged_attention(query, k_cache, v_cache, meta, 0.25, window=window)
        expected = windowed_reference(query, k_cache, v_cache, meta, 0.25, window, 0)
        torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=0)
        full = reference.paged_attention(
            query.cpu(), k_cache.cpu(), v_cache.cpu(), meta_on_cpu(meta), 0.25
        )
        assert torch.isnan(full).any() or not torch.allclose(full, expected, atol=ATOL)


def test_decode_partials_with_window():
    """Unmerged splits of a windowed decode merge to the windowed reference."""
    window, sinks, seq_lens = 512, 4, [700, 520, 100]
    k_cache, v_cache, meta = make_batch(
        [1] * 3, seq_lens, num_kv_heads=1, head_dim=16, tokens_per_block=16, seed=29
    )
    meta = free_outside_window(meta, k_cache, window, sinks)
    query = random_query(3, 2, 16, seed=30)
    partials = triton_backend.decode_partials(
        query, k_cache, v_cache, meta, 0.25, window=window, sinks=sinks
    )
    merged = merge_partials(partials.outputs.cpu(), partials.lse.cpu())
    expected = windowed_reference(query, k_cache, v_cache, meta, 0.25, window, sinks)
    torch.testing.assert_close(merged, expected, atol=ATOL, rtol=0)


# Soft-capping (Gemma 2) and a scale other than 1/sqrt(head_dim)


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [(MIXED_BATCH[0], MIXED_BATCH[1]), ([1] * 4, [1, 23, 70, 130])],
    ids=["prefill kernel", "decode kernel"],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_softcap_matches_reference(query_lens, seq_lens, num_splits, monkeypatch):
    """Scores softcap * tanh(q.k * scale / softcap), in both kernels and the decode partials;
    the cap is low enough that leaving it out fails."""
    monkeypatch.setattr(decode_launch, "choose_num_splits", lambda *args: num_splits)
    k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_kv_heads=1, head_dim=32, tokens_per_block=16, seed=11
    )
    query = random_query(sum(query_lens), 4, 32, seed=12)
    scale, softcap = 0.3, 1.5
    out = triton_backend.paged_attention(query, k_cache, v_cache, meta, scale, softcap=softcap)
    assert_matches_reference(out, query, k_cache, v_cache, meta, scale, softcap=softcap)
    uncapped = triton_backend.paged_attention(query, k_cache, v_cache, meta, scale)
    assert (out - uncapped).abs().max() > 0.05
    if meta.max_query_len == 1:
        partials = triton_backend.decode_partials(
            query, k_cache, v_cache, meta, scale, softcap=softcap
        )
        merged = merge_partials(partials.outputs.cpu(), partials.lse.cpu())
        assert_matches_reference(merged, query, k_cache, v_cache, meta, scale, softcap=softcap)

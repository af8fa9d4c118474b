"""fp8 / int8 KV caches (`backend.attention.kv_dtype`): the write kernel stores the values and
scales the torch reference stores, bit for bit, and the decode and prefill kernels read a
quantized cache as the reference does (windows, sinks, soft-capping, split-K, tiles across
pages).

Without a GPU the kernels run in Triton's interpreter. Slots that hold no token have NaN scales
(and NaN / 127 values), so a kernel that reads one returns NaN.
"""

from __future__ import annotations

import pytest
import torch

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.attention import kv_dtype, reference, triton_backend  # noqa: E402
from backend.attention.kernels import decode, decode_launch, kv_write  # noqa: E402
from backend.attention.kernels.prefill import prefill_attention  # noqa: E402
from tests.kernels.test_attention_kernels import (  # noqa: E402
    MIXED_BATCH,
    free_outside_window,
    make_batch,
    merge_partials,
    meta_on_cpu,
    random_query,
)

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
CACHE_DTYPES = [torch.float8_e4m3fn, torch.int8]
ATOL = 1e-4


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Compare float8 (and NaN) tensors bit for bit."""
    return t.cpu().view(torch.uint8) if t.element_size() == 1 else t.cpu()


def quantized_batch(dtype, query_lens, seq_lens, window=None, sinks=0, **shape):
    """make_batch's paged context quantized per head vector; empty slots get NaN scales."""
    k_cache, v_cache, meta = make_batch(query_lens, seq_lens, **shape)
    if window is not None:
        meta = free_outside_window(meta, k_cache, window, sinks)
    caches = []
    for cache in (k_cache.cpu(), v_cache.cpu()):
        empty = torch.isnan(cache).all(-1)
        values, scales = kv_dtype.quantize(torch.nan_to_num(cache), dtype)
        values.view(torch.uint8)[empty] = 0x7F  # fp8: NaN; int8: 127
        scales[empty] = float("nan")
        caches += [values.to(DEVICE), scales.to(DEVICE)]
    k_values, k_scales, v_values, v_scales = caches
    return k_values, v_values, meta, {"k_scales": k_scales, "v_scales": v_scales}


def expected(query, k_values, v_values, meta, scales, scale, window=None, sinks=0, softcap=None):
    on_cpu = {name: s.cpu() for name, s in scales.items()}
    return reference.paged_attention(
        query.cpu().float(),
        k_values.cpu(),
        v_values.cpu(),
        meta_on_cpu(meta),
        scale,
        window=window,
        sinks=sinks,
        softcap=softcap,
        **on_cpu,
    )


# ---------------------------------------------------------------------------------------------
# The write


def write_inputs(dtype, num_tokens=9, num_kv_heads=3, head_dim=32):
    """Keys and values of magnitudes from 1e-3 to 1e2, a zero vector, and vectors whose largest
    element is QMAX (scale 1: the values themselves are rounded, fp8 subnormals and ties too)."""
    gen = torch.Generator().manual_seed(5)
    shape = (num_tokens, num_kv_heads, head_dim)
    magnitude = 10 ** (torch.rand(num_tokens, num_kv_heads, 1, generator=gen) * 5 - 3)
    key = torch.randn(shape, generator=gen) * magnitude
    value = torch.randn(shape, generator=gen) * magnitude
    qmax = kv_dtype.QMAX[dtype]
    plain = (torch.rand(head_dim, generator=gen) * 2 - 1) * 10 ** (
        torch.rand(head_dim, generator=gen) * 5 - 3
    )
    ties = torch.tensor(
        [8.5, 9.5, -10.5, 0.5, 1.5, 2.5, 7.97, 300.0, 440.0, 2.0**-10, 3 * 2.0**-10]
    )
    plain[: len(ties)] = ties if dtype.is_floating_point else ties.clamp(-qmax, qmax)
    plain[-1] = qmax
    key[1, 0] = plain * qmax / plain.abs().max()
    value[2, 1] = plain
    key[3, 2] = 0.0
    return key.to(DEVICE), value.to(DEVICE)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["fp8", "int8"])
def test_write_kv_quantizes_as_the_reference_and_skips_padding(dtype):
    num_blocks, tokens_per_block, num_kv_heads, head_dim = 4, 4, 3, 32
    key, value = write_inputs(dtype, 9, num_kv_heads, head_dim)
    slots = torch.tensor([5, 0, 15, -1, 3, 4, 11, -1, 8], device=DEVICE)
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_scales = torch.zeros(shape[:3], dtype=kv_dtype.KV_SCALE_DTYPE, device=DEVICE)
    v_scales = torch.zeros_like(k_scales)
    expected_tensors = [t.cpu().clone() for t in (k_cache, v_cache, k_scales, v_scales)]
    keep = (slots >= 0).cpu()
    reference.write_kv(
        key.cpu()[keep],
        value.cpu()[keep],
        *expected_tensors[:2],
        slots.cpu()[keep],
        *expected_tensors[2:],
    )

    triton_backend.write_kv(key, value, k_cache, v_cache, slots, k_scales, v_scales)
    for got, want in zip((k_cache, v_cache, k_scales, v_scales), expected_tensors):
        assert torch.equal(as_bits(got), as_bits(want))


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["fp8", "int8"])
def test_quantize_rule(dtype):
    """Each vector's scale is its amax / QMAX rounded up to bfloat16 (no value past QMAX), and the
    values read back within half a step of the original."""
    key, _ = write_inputs(dtype)
    key = key.cpu()
    values, scales = kv_dtype.quantize(key, dtype)
    assert scales.dtype == torch.bfloat16 and values.dtype == dtype
    qmax = kv_dtype.QMAX[dtype]
    ideal = key.abs().amax(-1) / qmax
    s = scales.float()
    nonzero = ideal > 0
    assert (s[nonzero] >= ideal[nonzero]).all()
    assert (s[nonzero] <= ideal[nonzero] * (1 + 2**-7)).all()
    assert values.float().abs().max() <= qmax
    error = (kv_dtype.dequantize(values, scales) - key).abs()
    if dtype.is_floating_point:  # 3 mantissa bits; steps of 2**-9 * scale below 2**-6 * scale
        bound = key.abs() * 2**-4 + s[..., None] * 2**-10
    else:
        bound = s[..., None] * 0.5
    assert (error <= bound * (1 + 1e-6)).all()
    assert torch.equal(values[3, 2].float(), torch.zeros(values.shape[-1]))  # the zero vector


# ---------------------------------------------------------------------------------------------
# Reading: decode and prefill


DECODE_SEQ_LENS = [1, 16, 17, 70, 130]


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(
    "window,sinks,softcap", [(None, 0, None), (48, 4, 1.5)], ids=["global", "window-softcap"]
)
def test_decode_reads_a_quantized_cache_as_the_reference(dtype, num_splits, window, sinks, softcap):
    k_values, v_values, meta, scales = quantized_batch(
        dtype,
        [1] * len(DECODE_SEQ_LENS),
        DECODE_SEQ_LENS,
        window,
        sinks,
        num_kv_heads=2,
        head_dim=32,
        tokens_per_block=16,
        seed=31,
    )
    query = random_query(len(DECODE_SEQ_LENS), 4, 32, seed=32)
    out = decode.decode_attention(
        query,
        k_values,
        v_values,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len,
        0.2,
        num_splits=num_splits,
        window=window,
        sinks=sinks,
        softcap=softcap,
        **scales,
    )
    assert not torch.isnan(out).any()
    want = expected(query, k_values, v_values, meta, scales, 0.2, window, sinks, softcap)
    torch.testing.assert_close(out.cpu(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "dtype,query_dtype",
    [
        (torch.float8_e4m3fn, torch.float32),
        (torch.int8, torch.float32),
        (torch.float8_e4m3fn, torch.bfloat16),  # not int8: the interpreter's bf16 dot is wrong
    ],
    ids=["fp8", "int8", "fp8-bf16-query"],
)
def test_decode_tiles_within_one_page_read_a_quantized_cache_as_the_reference(
    dtype, query_dtype, monkeypatch
):
    """The H100's fp8-cache entry: 32-key tiles in 32-token pages, one page number a tile, the
    scales read beside the values (a bf16 query over fp8 takes the words path)."""
    config = dict(BLOCK_N=32, num_warps=2, num_stages=1)
    monkeypatch.setattr(decode_launch, "launch_config", lambda *args: config)
    k_values, v_values, meta, scales = quantized_batch(
        dtype,
        [1] * len(DECODE_SEQ_LENS),
        DECODE_SEQ_LENS,
        48,
        4,
        num_kv_heads=2,
        head_dim=32,
        tokens_per_block=32,
        seed=41,
    )
    query = random_query(len(DECODE_SEQ_LENS), 4, 32, dtype=query_dtype, seed=42)
    out = decode.decode_attention(
        query,
        k_values,
        v_values,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len,
        0.2,
        num_splits=2,
        window=48,
        sinks=4,
        **scales,
    )
    want = expected(query, k_values, v_values, meta, scales, 0.2, 48, 4)
    atol = ATOL if query_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["fp8", "int8"])
def test_decode_partials_of_a_quantized_cache_merge_to_the_reference(dtype, monkeypatch):
    monkeypatch.setattr(decode_launch, "choose_num_splits", lambda *args: 4)
    k_values, v_values, meta, scales = quantized_batch(
        dtype, [1] * 3, [130, 40, 1], 48, 4, num_kv_heads=1, head_dim=16, tokens_per_block=16
    )
    query = random_query(3, 2, 16, seed=33)
    partials = triton_backend.decode_partials(
        query, k_values, v_values, meta, 0.25, window=48, sinks=4, **scales
    )
    merged = merge_partials(partials.outputs.cpu(), partials.lse.cpu())
    want = expected(query, k_values, v_values, meta, scales, 0.25, 48, 4)
    torch.testing.assert_close(merged, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["fp8", "int8"])
def test_decode_partials_write_the_steps_own_keys_and_values(dtype, monkeypatch):
    """Given the step's keys and values (`new_kv`, the one-token path's), split 0 of each request
    and kv head quantizes them into the cache: the cache then holds what the KV-write kernel
    stores, bit for bit, and the merged splits are the reference's attention over it."""
    monkeypatch.setattr(decode_launch, "choose_num_splits", lambda *args: 4)
    seq_lens = [130, 40, 1, 17]
    k_values, v_values, meta, scales = quantized_batch(
        dtype, [1] * 4, seq_lens, num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=43
    )
    gen = torch.Generator().manual_seed(44)
    new_k = (torch.randn(4, 2, 32, generator=gen) * 3).to(DEVICE)
    new_v = torch.randn(4, 2, 32, generator=gen).to(DEVICE)
    want = [k_values.clone(), v_values.clone(), scales["k_scales"].clone()]
    want.append(scales["v_scales"].clone())
    kv_write.write_kv(new_k, new_v, *want[:2], meta.slot_mapping, *want[2:])
    query = random_query(4, 4, 32, seed=45)
    partials = triton_backend.decode_partials(
        query, k_values, v_values, meta, 0.25, new_kv=(new_k, new_v), **scales
    )
    got = [k_values, v_values, scales["k_scales"], scales["v_scales"]]
    for g, w in zip(got, want):  # bytes: the scales of empty slots are NaN
        assert torch.equal(g.cpu().view(torch.uint8), w.cpu().view(torch.uint8))
    merged = merge_partials(partials.outputs.cpu(), partials.lse.cpu())
    torch.testing.assert_close(
        merged, expected(query, k_values, v_values, meta, scales, 0.25), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize(
    "window,sinks,softcap", [(None, 0, None), (24, 4, 1.5)], ids=["global", "window-softcap"]
)
def test_prefill_reads_a_quantized_cache_as_the_reference(dtype, window, sinks, softcap):
    """A mixed batch (chunks and decode rows) with 32-key tiles spanning 16-token pages."""
    query_lens, seq_lens = MIXED_BATCH
    k_values, v_values, meta, scales = quantized_batch(
        dtype,
        query_lens,
        seq_lens,
        window,
        sinks,
        num_kv_heads=2,
        head_dim=32,
        tokens_per_block=16,
        seed=34,
    )
    query = random_query(sum(query_lens), 4, 32, seed=35)
    out = prefill_attention(
        query,
        k_values,
        v_values,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        0.2,
        block_m=16,
        block_n=32,
        window=window,
        sinks=sinks,
        softcap=softcap,
        **scales,
    )
    assert not torch.isnan(out).any()
    want = expected(query, k_values, v_values, meta, scales, 0.2, window, sinks, softcap)
    torch.testing.assert_close(out.cpu(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1], [20, 45]), ([6, 1], [6, 30])])
def test_half_precision_query_over_a_quantized_cache(dtype, query_lens, seq_lens):
    """The cache's values convert to the query's dtype for the dots (fp16 here: the interpreter's
    bf16 dot is wrong; bf16 on GPU)."""
    k_values, v_values, meta, scales = quantized_batch(
        dtype, query_lens, seq_lens, num_kv_heads=2, head_dim=32, tokens_per_block=16
    )
    query = random_query(sum(query_lens), 4, 32, dtype=torch.float16, seed=36)
    out = triton_backend.paged_attention(query, k_values, v_values, meta, 32**-0.5, **scales)
    assert out.dtype == torch.float16
    want = expected(query, k_values, v_values, meta, scales, 32**-0.5)
    torch.testing.assert_close(out.cpu().float(), want, atol=2e-3, rtol=0)


@pytest.mark.parametrize("v_scale_factor", [1.0, 1e-4])
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([1, 1, 1], [20, 45, 70]),  # decodes alone: the decode kernel
        ([1, 1, 5], [20, 45, 30]),  # a prompt chunk too: the prefill kernel
    ],
)
def test_bfloat16_query_over_an_fp8_cache_keeps_small_values_exact(
    query_lens, seq_lens, v_scale_factor
):
    """A bf16 query over an fp8 cache (what bf16 models serve with) scores as the reference, and
    values of 1e-4 the size (small value scales) stay as exact as unit ones. The kernels read
    the tiles as words widened to float16 (inline PTX on a GPU, Triton's casts under the
    interpreter) and dot in float16, the probabilities scaled by v_scale over its tile max,
    clear of float16's subnormals."""
    k_values, v_values, meta, scales = quantized_batch(
        torch.float8_e4m3fn, query_lens, seq_lens, num_kv_heads=2, head_dim=32, tokens_per_block=16
    )
    scales["v_scales"] = scales["v_scales"] * v_scale_factor
    query = random_query(sum(query_lens), 4, 32, dtype=torch.bfloat16, seed=39)
    out = triton_backend.paged_attention(query, k_values, v_values, meta, 32**-0.5, **scales)
    assert out.dtype == torch.bfloat16
    want = expected(query, k_values, v_values, meta, scales, 32**-0.5)
    got = out.cpu().float() / v_scale_factor
    torch.testing.assert_close(got, want / v_scale_factor, atol=1e-2, rtol=0)


@pytest.mark.parametrize("dtype,most", [(torch.float8_e4m3fn, 0.02), (torch.int8, 0.005)])
def test_quantized_attention_stays_close_to_float(dtype, most):
    """The reference over the quantized cache against the float cache it came from (unit normal
    keys and values): a mean error of about 0.009 for fp8, 0.002 for int8."""
    query_lens, seq_lens = MIXED_BATCH
    shape = dict(num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=37)
    k_cache, v_cache, meta = make_batch(query_lens, seq_lens, **shape)
    k_values, v_values, _, scales = quantized_batch(dtype, query_lens, seq_lens, **shape)
    query = random_query(sum(query_lens), 4, 32, seed=38)
    exact = reference.paged_attention(
        query.cpu(), k_cache.cpu(), v_cache.cpu(), meta_on_cpu(meta), 0.2
    )
    got = expected(query, k_values, v_values, meta, scales, 0.2)
    difference = (got - exact).abs().mean().item()
    assert 0 < difference < most

"""Triton RMSNorm (+ residual), rotary-embedding, activation, embedding and argmax kernels against
torch."""

from __future__ import annotations

import pytest
import torch

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.attention.kernels.kv_write import write_kv  # noqa: E402
from backend.attention.kernels.rope import apply_rotary_  # noqa: E402
from backend.kernels.activation import silu_and_mul, silu_and_mul_e4m3  # noqa: E402
from backend.kernels.argmax import CHUNK, argmax_rows  # noqa: E402
from backend.kernels.embedding import BLOCK as EMBEDDING_BLOCK  # noqa: E402
from backend.kernels.embedding import embedding
from backend.kernels.fp8_gemm import quantize_rows  # noqa: E402
from backend.kernels.rmsnorm import rms_norm  # noqa: E402
from backend.layers.norm import RMSNorm  # noqa: E402
from backend.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from backend.model_config import RopeConfig  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]


@pytest.mark.parametrize("hidden", [64, 96])  # 96: the row is masked to a block of 128
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_module(hidden, with_residual):
    torch.manual_seed(0)
    module = RMSNorm(hidden, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    x = torch.randn(7, hidden, device=DEVICE) * 3
    residual = torch.randn(7, hidden, device=DEVICE) if with_residual else None
    expected = module(x, residual)
    got = rms_norm(x, module.weight.detach(), 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[1], expected[1])
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_into_e4m3_rows_equals_the_norm_then_the_row_quantizer(dtype, with_residual):
    """RMSNorm writing e4m3 rows and their scales (for an `fp8` qkv or gate|up projection's
    scaled GEMM) gives what RMSNorm and then the row quantizer give, bit for bit, and the same
    new residual; a zero row included."""
    torch.manual_seed(2)
    hidden = 96  # masked to a block of 128
    weight = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    x = (torch.randn(5, hidden, device=DEVICE) * 3).to(dtype)
    x[3] = 0
    residual = torch.randn(5, hidden, device=DEVICE).to(dtype) if with_residual else None
    if with_residual:
        residual[3] = 0
    got = rms_norm(x, weight, 1e-5, residual, e4m3=True)
    want = rms_norm(x, weight, 1e-5, residual)
    (q, scales), want_out = (got[0], want[0]) if with_residual else (got, want)
    want_q, want_scales = quantize_rows(want_out)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (5, 1)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if with_residual:
        assert torch.equal(got[1], want[1])


def test_rms_norm_half_precision_strided_rows():
    torch.manual_seed(1)
    hidden = 64
    weight = (torch.rand(hidden, device=DEVICE) + 0.5).half()
    x = (torch.randn(5, 2 * hidden, device=DEVICE) * 2).half()[:, :hidden]  # row stride 2*hidden
    residual = torch.randn(5, hidden, device=DEVICE).half()
    module = RMSNorm(hidden, eps=1e-6).to(DEVICE).half()
    with torch.no_grad():
        module.weight.copy_(weight)
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    expected_out, expected_residual = module(x, residual)
    assert out.dtype == torch.float16
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected_out, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (6, 1, 64)])
def test_rotary_matches_torch_in_place_on_fused_qkv(num_heads, num_kv_heads, head_dim):
    torch.manual_seed(2)
    rope = RopeConfig(
        type="llama3",
        theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    rotary = RotaryEmbedding(rope, head_dim, max_position_embeddings=256, max_positions=256)
    rotary.build_cache(DEVICE)
    num_tokens = 9
    positions = torch.randint(0, 256, (num_tokens,), device=DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    cos, sin = rotary(positions, torch.float32)
    expected_q, expected_k = apply_rotary(q.clone(), k.clone(), cos, sin)

    apply_rotary_(q, k, rotary.cos_sin, positions)
    torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, expected_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("size", [64, 1536])  # 1536: two column tiles, the last one masked
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(size, dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(5, 2 * size, device=DEVICE) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    # bfloat16: torch's exp and Triton's may round float32 silu apart by a last bit
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(
        silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, **tolerance
    )


@pytest.mark.parametrize("size", [1000, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_into_e4m3_rows_equals_the_two_kernels(size, dtype):
    """silu·mul writing e4m3 rows and their scales (for an `fp8` down projection's scaled GEMM)
    gives what silu·mul and then the row quantizer give, bit for bit; zero rows included."""
    torch.manual_seed(1)
    gate_up = (torch.randn(4, 2 * size, device=DEVICE) * 4).to(dtype)
    gate_up[2] = 0
    q, scales = silu_and_mul_e4m3(gate_up)
    want_q, want_scales = quantize_rows(silu_and_mul(gate_up))
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (4, 1)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_rotary_with_kv_write_stores_rotated_keys_and_values_at_their_slots():
    torch.manual_seed(3)
    num_heads, num_kv_heads, head_dim, tokens_per_block = 4, 2, 32, 4
    rope = RopeConfig(
        type="default",
        theta=10000.0,
        factor=1.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    rotary = RotaryEmbedding(rope, head_dim, max_position_embeddings=64, max_positions=64)
    rotary.build_cache(DEVICE)
    positions = torch.tensor([0, 5, 9, 3], device=DEVICE)
    slots = torch.tensor([6, 1, -1, 10], device=DEVICE)  # -1: a padded row, skipped
    qkv = torch.randn(4, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).half()
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    q, k, v = (t.view(4, -1, head_dim) for t in (q, k, v))
    cos, sin = rotary(positions, torch.float16)
    expected_q, expected_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    k_cache = torch.zeros(3, tokens_per_block, num_kv_heads, head_dim, device=DEVICE).half()
    v_cache = torch.zeros_like(k_cache)

    apply_rotary_(q, k, rotary.cos_sin, positions, (v, k_cache, v_cache, slots))
    torch.testing.assert_close(q, expected_q, atol=2e-3, rtol=2e-3)
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], expected_k[row], atol=2e-3, rtol=2e-3)
            assert torch.equal(flat_v[slot], v[row])
    written = set(s for s in slots.tolist() if s >= 0)
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("num_kv_heads", [2, 3])  # 3: heads padded to 4
def test_rotary_with_quantized_kv_write_stores_what_the_kv_write_kernel_stores(
    cache_dtype, num_kv_heads
):
    """Into an fp8 / int8 cache, the fused rotation stores the values and scales that rotating
    and then the KV-write kernel store, bit for bit; padded rows and other slots untouched."""
    torch.manual_seed(4)
    num_heads, head_dim, tokens_per_block, tokens = 6, 32, 4, 5
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64, 64)
    rotary.build_cache(DEVICE)
    positions = torch.tensor([0, 5, 9, 3, 17], device=DEVICE)
    slots = torch.tensor([6, 1, -1, 10, 2], device=DEVICE)
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(tokens, sum(widths), device=DEVICE).bfloat16() * 3
    qkv[4, widths[0] : widths[0] + head_dim] = 0  # an all-zero key vector: the smallest scale

    def caches():
        values = torch.zeros(3, tokens_per_block, num_kv_heads, head_dim, device=DEVICE)
        scales = torch.zeros(3, tokens_per_block, num_kv_heads, device=DEVICE).bfloat16()
        return [values.to(cache_dtype), values.to(cache_dtype), scales, scales.clone()]

    def views(buffer):
        q, k, v = buffer.split(widths, -1)
        return (t.view(tokens, -1, head_dim) for t in (q, k, v))

    fused, separate = caches(), caches()
    q, k, v = views(qkv.clone())
    apply_rotary_(q, k, rotary.cos_sin, positions, (v, *fused[:2], slots), tuple(fused[2:]))
    want_q, want_k, want_v = views(qkv.clone())
    apply_rotary_(want_q, want_k, rotary.cos_sin, positions)
    write_kv(want_k, want_v, *separate[:2], slots, *separate[2:])
    assert torch.equal(q, want_q)
    for got, want in zip(fused, separate):
        assert torch.equal(
            got.view(torch.uint8 if got.element_size() == 1 else torch.int16),
            want.view(torch.uint8 if want.element_size() == 1 else torch.int16),
        )
    assert fused[0].view(torch.uint8).any() and fused[2].any()  # something was written


def test_argmax_matches_torch_with_ties_inside_and_across_chunks():
    torch.manual_seed(5)
    vocab = 2 * CHUNK + 1000  # three chunks, the last one partial
    logits = torch.randn(5, vocab, device=DEVICE)
    logits[1, [7, CHUNK + 3, 2 * CHUNK + 9]] = 50.0  # equal maxima in three chunks: first wins
    logits[2, [CHUNK + 10, CHUNK + 11]] = 50.0  # equal maxima in one chunk
    logits[3, :] = float("-inf")  # nothing allowed: index 0, as torch
    logits[4, -1] = 50.0  # the very last column
    wide = torch.randn(2, vocab + 64, device=DEVICE)[:, 64:]  # rows with a stride, not contiguous
    for x in (logits, wide, logits[:1]):
        torch.testing.assert_close(argmax_rows(x).cpu(), x.argmax(dim=-1).cpu(), rtol=0, atol=0)
    buffer = torch.full((8,), -5, dtype=torch.int64, device=DEVICE)  # into a longer buffer
    assert argmax_rows(logits, out=buffer[:5]).data_ptr() == buffer.data_ptr()
    assert buffer.tolist() == logits.argmax(dim=-1).tolist() + [-5, -5, -5]


def test_argmax_skips_each_rows_banned_ids_like_masking_them():
    torch.manual_seed(6)
    vocab = 2 * CHUNK + 1000
    logits = torch.randn(4, vocab, device=DEVICE)
    top = logits.argmax(dim=-1)
    second = logits.scatter(1, top[:, None], float("-inf")).argmax(dim=-1)
    banned = torch.full((4, 3), -1, dtype=torch.int64, device=DEVICE)
    banned[0, 0] = top[0]  # the maximum banned: the runner-up wins
    banned[1, 2] = top[1]  # in any column of the row's bans
    banned[2, :2] = torch.tensor([second[2], top[2]])  # both: the third best
    banned[3, 0] = (top[3] + 1) % vocab  # another id: nothing changes
    masked = logits.clone()
    for row in range(4):
        ids = [int(i) for i in banned[row] if i >= 0]
        masked[row, ids] = float("-inf")
    assert argmax_rows(logits, banned=banned).tolist() == masked.argmax(dim=-1).tolist()
    assert argmax_rows(logits, banned=banned)[:2].tolist() == second[:2].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_gathers_rows_like_torch_and_zeros_out_of_range_ids(dtype):
    torch.manual_seed(0)
    hidden = EMBEDDING_BLOCK + 40  # two column tiles, the last partial
    weight = torch.randn(50, hidden, device=DEVICE).to(dtype)
    ids = torch.tensor([3, 49, 0, 3, 17], device=DEVICE)
    assert torch.equal(embedding(ids, weight), torch.nn.functional.embedding(ids, weight))
    assert embedding(ids[:0], weight).shape == (0, hidden)
    out = embedding(torch.tensor([50, -1, 2], device=DEVICE), weight)
    assert not out[:2].any() and torch.equal(out[2], weight[2])

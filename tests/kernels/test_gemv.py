"""The one-token linear kernel (GEMV, with its norm / silu·mul / residual fusions) against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.kernels.gemv import gemv, supports  # noqa: E402
from backend.layers.norm import RMSNorm  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got, expected, dtype):
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 192), (72, 1024)])
def test_plain_product_with_bias(dtype, n, k):
    num_tokens = 1
    torch.manual_seed(0)
    x = torch.randn(num_tokens, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    assert supports(x, weight)
    _close(gemv(x, weight), F.linear(x.float(), weight.float()).to(dtype), dtype)
    _close(
        gemv(x, weight, bias), F.linear(x.float(), weight.float(), bias.float()).to(dtype), dtype
    )
    wide = dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2)
    _close(
        gemv(x, weight, bias, config=wide),
        F.linear(x.float(), weight.float(), bias.float()).to(dtype),
        dtype,
    )
    for prefetch in {64, 1 << (k.bit_length() - 1)}:  # read before the loop: part of K, or all
        prefetched = dict(wide, PREFETCH_K=prefetch)
        _close(
            gemv(x, weight, bias, config=prefetched),
            F.linear(x.float(), weight.float(), bias.float()).to(dtype),
            dtype,
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_out_is_the_half_precision_result_widened(dtype):
    """Logits come out in float32 from the same kernel, rounded to the activation dtype first,
    exactly as the half-precision result followed by .float()."""
    torch.manual_seed(3)
    x = torch.randn(1, 256, device=DEVICE).to(dtype)
    weight = (torch.randn(80, 256, device=DEVICE) / 16).to(dtype)
    wide = torch.empty(1, 80, dtype=torch.float32, device=DEVICE)
    assert gemv(x, weight, out=wide) is wide
    assert torch.equal(wide, gemv(x, weight).float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_prologue_matches_rms_norm_module(dtype):
    torch.manual_seed(1)
    num_tokens, n, k = 1, 32, 128
    norm = RMSNorm(k, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm = norm.to(dtype)
    x = (torch.randn(num_tokens, 2 * k, device=DEVICE) * 4).to(dtype)[:, :k]  # strided rows
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    expected = F.linear(norm(x).float(), weight.float()).to(dtype)
    _close(gemv(x, weight, norm_weight=norm.weight.detach(), eps=1e-5), expected, dtype)
    prefetched = dict(BLOCK_N=8, BLOCK_K=64, PREFETCH_K=64)  # the norm's sum spans both parts
    _close(
        gemv(x, weight, norm_weight=norm.weight.detach(), eps=1e-5, config=prefetched),
        expected,
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul_prologue_and_in_place_residual(dtype):
    torch.manual_seed(2)
    num_tokens, n, k = 1, 48, 64
    gate_up = torch.randn(num_tokens, 2 * k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    residual = torch.randn(num_tokens, n, device=DEVICE).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    activated = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    expected = (
        F.linear(activated.float(), weight.float()).to(dtype).float() + residual.float()
    ).to(dtype)
    before = residual.clone()
    got = gemv(gate_up, weight, silu_mul=True, residual=residual.clone())
    _close(got, expected, dtype)
    got = gemv(
        gate_up, weight, silu_mul=True, residual=residual, out=residual, config=dict(PREFETCH_K=k)
    )
    assert got.data_ptr() == residual.data_ptr()
    _close(got, expected, dtype)
    assert not torch.equal(residual, before)


def test_refuses_what_it_does_not_take():
    x = torch.randn(2, 64).half()
    assert supports(x[:1], torch.randn(8, 64).half())
    assert not supports(x, torch.randn(8, 64).half())  # two tokens
    assert not supports(x[:4].float(), torch.randn(8, 64))  # float32
    assert not supports(x[:4, :48], torch.randn(8, 48).half())  # K not in 64-wide tiles


@pytest.mark.parametrize(
    "model_type,attention,quantization",  # qwen2: qkv bias
    [
        ("llama", "torch", "none"),
        ("llama", "triton", "none"),
        ("qwen2", "torch", "none"),
        ("qwen2", "triton", "none"),
        ("llama", "triton", "int8_wo"),
        ("qwen2", "triton", "int4_wo"),  # groups of 128 (hidden), 64 (the down projection)
    ],
)
def test_one_token_layers_match_the_general_layers(model_type, attention, quantization):
    """The decoder layers run as fused one-token kernels (`forward_one_token`) against the general
    layers, on an fp16 decode step at position 6 with 6 tokens of context in the cache. Same
    hidden states up to fp16 rounding, same keys and values in the cache. Both attention
    backends: the Triton one is what GPU steps run. Quantized weights stream through the same
    kernels (the general layers de-quantize them)."""
    from backend.attention import AttentionMetadata, get_attention_backend
    from backend.layers import AttentionStep
    from backend.loading.model_loader import build_model
    from backend.loading.presets import init_random_weights
    from backend.model_config import ModelConfig

    config = ModelConfig.from_dict(
        {
            "model_type": model_type,
            "vocab_size": 300,
            "hidden_size": 128,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
        }
    )
    model = build_model(
        config, torch.device(DEVICE), torch.float16, get_attention_backend(attention, DEVICE), 64
    )
    init_random_weights(model, seed=3)
    if quantization != "none":
        from backend.loading.quantized_checkpoint import quantize_at_load

        assert quantize_at_load(model, quantization) == 8  # qkv, o, gate_up, down of 2 layers
    input_ids = torch.tensor([99], device=DEVICE)
    positions = torch.tensor([6], device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([14], device=DEVICE),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([7], dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(
            [[1, 2]], dtype=torch.int32, device=DEVICE
        ),  # slots 8..15, 16..23
        max_query_len=1,
        max_seq_len=7,
        query_lens_cpu=[1],
        seq_lens_cpu=[7],
    )
    caches = [torch.zeros(2, 2, 3, 8, 2, 32, dtype=torch.float16, device=DEVICE) for _ in range(2)]
    for cache in caches:  # the request's earlier context (slots 8..13), identical in both
        cache[:, :, 1, :6] = torch.randn(
            2, 2, 6, 2, 32, generator=torch.Generator().manual_seed(4)
        ).half()

    layers, rotary = model.model.layers, model.model.rotary
    with torch.inference_mode():
        hidden = model.model.embed_tokens(input_ids)
        rotation = rotary.rotator(positions, hidden.dtype)
        general_step, fused_step = (
            AttentionStep(rotation, meta, caches[0]),
            AttentionStep(rotation, meta, caches[1]),
        )
        general, residual = hidden, None
        fused = hidden.clone()
        for i, layer in enumerate(layers):
            general, residual = layer(general, residual, general_step)
            layer.forward_one_token(fused, fused_step)
            _close(fused, general + residual, torch.float16)
            torch.testing.assert_close(caches[1][i], caches[0][i], atol=2e-3, rtol=2e-3)
            general, residual = fused.clone(), None  # same input to the next layer for both


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_n", [(4, 2, 32, 4), (6, 2, 64, 8), (2, 2, 16, 2)]
)
@pytest.mark.parametrize("slot", [11, -1])  # -1: a padded row, nothing written to the cache
def test_qkv_rope_matches_norm_projection_rotary_and_cache_write(
    num_heads, num_kv_heads, head_dim, block_n, slot
):
    from backend.kernels.qkv_rope import qkv_rope_gemv
    from backend.layers.rotary import RotaryEmbedding, apply_rotary
    from backend.model_config import RopeConfig

    torch.manual_seed(6)
    dtype, hidden, position = torch.float16, 128, 9
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    x = torch.randn(1, hidden, device=DEVICE).to(dtype)
    norm = RMSNorm(hidden, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm = norm.to(dtype)
    weight = (torch.randn(q_size + 2 * kv_size, hidden, device=DEVICE) / hidden**0.5).to(dtype)
    bias = torch.randn(q_size + 2 * kv_size, device=DEVICE).to(dtype)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64, 64).to(DEVICE)
    k_cache = torch.zeros(3, 8, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.tensor([position], device=DEVICE)
    slots = torch.tensor([slot], device=DEVICE)

    got = qkv_rope_gemv(
        x,
        weight,
        bias,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        cos_sin=rotary.cos_sin,
        positions=positions,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slots,
        norm_weight=norm.weight.detach(),
        eps=1e-5,
        config=dict(BLOCK_N=block_n, BLOCK_K=64),
    )

    qkv = F.linear(norm(x).float(), weight.float(), bias.float()).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = rotary.cos_sin[positions, 0, None, :], rotary.cos_sin[positions, 1, None, :]
    q, k = apply_rotary(
        q.view(1, num_heads, head_dim).float(), k.view(1, num_kv_heads, head_dim).float(), cos, sin
    )
    _close(got, torch.cat([q.reshape(1, -1), k.reshape(1, -1), v.float()], dim=-1).to(dtype), dtype)
    if slot < 0:
        assert not k_cache.any() and not v_cache.any()
    else:
        _close(
            k_cache[slot // 8, slot % 8],
            got[0, q_size : q_size + kv_size].view(num_kv_heads, head_dim),
            dtype,
        )
        _close(
            v_cache[slot // 8, slot % 8],
            got[0, q_size + kv_size :].view(num_kv_heads, head_dim),
            dtype,
        )
        assert (
            k_cache.count_nonzero() == k_cache[slot // 8, slot % 8].count_nonzero()
        )  # nowhere else


@pytest.mark.parametrize("num_splits,context", [(1, 150), (4, 150), (64, 1100)])
@pytest.mark.parametrize(
    "prefetch", [128, 64, 0, None]
)  # operand merged in one tile, the loop; None: defaults
def test_merge_prologue_equals_the_merged_attention_projected(num_splits, context, prefetch):
    """The o projection reading split decode attention unmerged (`partials`) equals the same
    projection of the attention output the decode kernel merges itself, residual included. With
    a graph's 64-split ceiling a long context's splits were merged by attention into the first,
    and the projection reads the first READ_MERGE_MAX_SPLITS only."""
    from backend.attention import SplitPartials
    from backend.attention.kernels.decode import (
        READ_MERGE_MAX_SPLITS,
        decode_attention,
        decode_attention_partials,
    )
    from tests.kernels.test_attention_kernels import make_batch, random_query

    torch.manual_seed(8)
    dtype, heads, head_dim, n = torch.float16, 4, 32, 96
    k_cache, v_cache, meta = make_batch(
        [1], [context], num_kv_heads=2, head_dim=head_dim, tokens_per_block=16, dtype=dtype, seed=3
    )
    query = random_query(1, heads, head_dim, dtype=dtype)
    args = (
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len,
        0.2,
    )
    attention = decode_attention(*args, num_splits=num_splits).reshape(1, heads * head_dim)
    partials = SplitPartials(
        *decode_attention_partials(*args, num_splits=num_splits),
        weighed_splits=min(num_splits, READ_MERGE_MAX_SPLITS),
    )
    weight = (torch.randn(n, heads * head_dim, device=DEVICE) / 12).to(dtype)
    residual = torch.randn(1, n, device=DEVICE).to(dtype)
    config = None if prefetch is None else dict(BLOCK_N=4, BLOCK_K=64, PREFETCH_K=prefetch)
    got = residual.clone()
    gemv(None, weight, partials=partials, residual=got, out=got, config=config)
    expected = gemv(attention, weight, residual=residual, config=config)
    _close(got, expected, dtype)
    _close(
        got,
        (F.linear(attention.float(), weight.float()).to(dtype).float() + residual.float()).to(
            dtype
        ),
        dtype,
    )

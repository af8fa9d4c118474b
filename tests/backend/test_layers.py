"""backend/layers against their torch references (transformers' modules where it has one), and the
one-token forms of the layers (fused kernels, under the Triton interpreter on CPU) against the
general forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.attention import AttentionMetadata, SplitPartials, get_attention_backend  # noqa: E402
from backend.layers import (
    AttentionStep,
    Embedding,
    GatedMLP,
    Linear,
    LMHead,
    RMSNorm,  # noqa: E402
    RotaryEmbedding,
    Rotation,
    SelfAttention,
    silu_and_mul,
)
from backend.model_config import ModelConfig, RopeConfig  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
HALF = torch.float16
HALF_TOLERANCE = dict(atol=2e-3, rtol=2e-3)


def _filled(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight") or name == "weight" and param.dim() == 1:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_transformers_and_adds_the_residual_first(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ours, theirs = RMSNorm(64, eps=1e-5), LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(theirs.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    assert torch.equal(ours(x), theirs(x))
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, theirs(x + residual))


def test_linear_is_torch_linear_and_merged_shards_are_the_projections_stacked():
    torch.manual_seed(1)
    qkv = _filled(Linear.merged(32, {"q_proj": 16, "k_proj": 8, "v_proj": 8}, bias=True), seed=1)
    assert qkv.shards == {"q_proj": (0, 16), "k_proj": (16, 8), "v_proj": (24, 8)}
    x = torch.randn(3, 32)
    assert torch.equal(qkv(x), F.linear(x, qkv.weight, qkv.bias))
    k = F.linear(x, qkv.weight[16:24], qkv.bias[16:24])
    torch.testing.assert_close(qkv(x)[:, 16:24], k)
    assert Linear(32, 8).bias is None and [n for n, _ in Linear(32, 8).named_parameters()] == [
        "weight"
    ]


def test_silu_and_mul_and_embedding_equal_torch():
    torch.manual_seed(2)
    gate_up = torch.randn(4, 24)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate_up[:, :12]) * gate_up[:, 12:])
    embedding = _filled(Embedding(50, 16), seed=2)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(embedding(ids), embedding.weight[ids])


def test_one_token_linear_fusions_equal_the_unfused_layers():
    """`Linear.one_token` (one GEMV) against the layers it replaces: norm then linear, silu·mul
    then linear, linear then the residual add."""
    torch.manual_seed(3)
    norm = _filled(RMSNorm(128, eps=1e-5), seed=3).to(DEVICE, HALF)
    gate_up = _filled(Linear.merged(128, {"gate_proj": 64, "up_proj": 64}), seed=4).to(DEVICE, HALF)
    down = _filled(Linear(64, 128), seed=5).to(DEVICE, HALF)
    residual = torch.randn(1, 128, device=DEVICE).to(HALF)
    with torch.inference_mode():
        expected_gate_up = gate_up(norm(residual))
        got_gate_up = gate_up.one_token(residual, norm=norm)
        torch.testing.assert_close(got_gate_up, expected_gate_up, **HALF_TOLERANCE)
        expected = down(silu_and_mul(got_gate_up)) + residual
        got = residual.clone()
        assert down.one_token(got_gate_up, silu_mul=True, residual=got, out=got) is got
    torch.testing.assert_close(got, expected, **HALF_TOLERANCE)


def test_lm_head_is_final_norm_then_projection_in_float32_and_its_one_token_form_agrees():
    torch.manual_seed(4)
    norm = _filled(RMSNorm(64, eps=1e-6), seed=6).to(DEVICE, HALF)
    head = _filled(LMHead(64, 96), seed=7).to(DEVICE, HALF)
    hidden = torch.randn(3, 64, device=DEVICE).to(HALF)
    with torch.inference_mode():
        logits = head(hidden, norm)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, F.linear(norm(hidden), head.weight).float())
        one_row = torch.empty(1, 96, dtype=torch.float32, device=DEVICE)
        head.one_token(hidden[:1], norm=norm, out=one_row)
    torch.testing.assert_close(one_row, logits[:1], **HALF_TOLERANCE)


def _decode_step(seq_len: int, tokens_per_block: int = 8):
    """One request decoding its token at position seq_len - 1; its context in blocks 1, 2, ..."""
    blocks = -(-seq_len // tokens_per_block)
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device=DEVICE)[None]
    slot = (
        int(table[0, (seq_len - 1) // tokens_per_block]) * tokens_per_block
        + (seq_len - 1) % tokens_per_block
    )
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot], device=DEVICE),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        block_tables=table,
        max_query_len=1,
        max_seq_len=seq_len,
        query_lens_cpu=[1],
        seq_lens_cpu=[seq_len],
    )
    return meta, blocks + 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_self_attention_one_token_form_equals_the_general_form(backend):
    """`add_one_token` (qkv + norm + rotary + KV write in one kernel; with the Triton backend, split
    partials merged by the o projection) adds to the residual what the general form computes, and
    leaves the same keys and values in the cache."""
    config = ModelConfig.from_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 300,
            "hidden_size": 128,
            "intermediate_size": 192,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
        }
    )
    attention_backend = get_attention_backend(backend, DEVICE)
    attention = _filled(SelfAttention(config, 0, attention_backend), seed=8).to(DEVICE, HALF)
    norm = _filled(RMSNorm(128, eps=1e-6), seed=9).to(DEVICE, HALF)
    rotary = RotaryEmbedding(RopeConfig(), 32, 512, 512).to(DEVICE)
    meta, num_blocks = _decode_step(seq_len=300)
    context = torch.randn(
        1, 2, num_blocks, 8, 2, 32, generator=torch.Generator().manual_seed(5)
    ).to(DEVICE, HALF)
    caches = [context.clone(), context.clone()]
    residual = torch.randn(1, 128, device=DEVICE).to(HALF)
    rotation = rotary.rotator(torch.tensor([299], device=DEVICE), HALF)
    with torch.inference_mode():
        expected = residual + attention(norm(residual), AttentionStep(rotation, meta, caches[0]))
        got = residual.clone()
        attention.add_one_token(got, norm, AttentionStep(rotation, meta, caches[1]))
    torch.testing.assert_close(got, expected, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(caches[1], caches[0], **HALF_TOLERANCE)


@pytest.mark.parametrize(
    "backend,cache_dtype",
    [("torch", torch.float8_e4m3fn), ("triton", torch.float8_e4m3fn), ("triton", torch.int8)],
)
def test_self_attention_over_a_quantized_cache(backend, cache_dtype):
    """With an fp8 / int8 cache, the one-token form (its qkv kernel leaves the quantizing write to
    the attention: the Triton decode kernel, or `write_kv` before the torch one) and the general
    form with the fused rotary kernel (which quantizes as it writes) add to the residual what the
    general form with torch's rotary does, and store the same token."""
    from backend.attention import kv_dtype

    config = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 300,
            "hidden_size": 128,
            "intermediate_size": 192,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
        }
    )
    attention_backend = get_attention_backend(backend, DEVICE)
    attention = _filled(SelfAttention(config, 0, attention_backend), seed=13).to(DEVICE, HALF)
    norm = _filled(RMSNorm(128, eps=1e-6), seed=14).to(DEVICE, HALF)
    rotary = RotaryEmbedding(RopeConfig(), 32, 512, 512).to(DEVICE)
    meta, num_blocks = _decode_step(seq_len=100)
    context = torch.randn(1, 2, num_blocks, 8, 2, 32, generator=torch.Generator().manual_seed(6))
    values, scales = kv_dtype.quantize(context, cache_dtype)
    caches = [(values.clone().to(DEVICE), scales.clone().to(DEVICE)) for _ in range(3)]
    residual = torch.randn(1, 128, generator=torch.Generator().manual_seed(15)).to(DEVICE, HALF)
    positions = torch.tensor([99], device=DEVICE)
    torch_rotation = rotary.rotator(positions, HALF)
    fused_rotation = Rotation(positions, rotary.cos_sin, None, None)

    def step(rotation, cache):
        return AttentionStep(rotation, meta, cache[0], kv_scales=cache[1])

    with torch.inference_mode():
        expected = residual + attention(norm(residual), step(torch_rotation, caches[0]))
        fused = residual + attention(norm(residual), step(fused_rotation, caches[1]))
        one_token = residual.clone()
        attention.add_one_token(one_token, norm, step(torch_rotation, caches[2]))
    slot = int(meta.slot_mapping[0])
    stored = [(v.flatten(2, 3)[..., slot, :, :], s.flatten(2, 3)[..., slot, :]) for v, s in caches]
    written = [kv_dtype.dequantize(v, s) for v, s in stored]
    assert not torch.equal(
        written[0], kv_dtype.dequantize(values, scales).flatten(2, 3)[..., slot, :, :].to(DEVICE)
    )
    # The three paths compute K/V in half precision apart; a value on a rounding boundary of
    # the cache dtype may land one step apart, never more.
    codes, scale = stored[0][0].float(), stored[0][1].float()[..., None]
    if cache_dtype.is_floating_point:  # e4m3: 3 mantissa bits, subnormal step 2^-9
        step = torch.exp2(torch.floor(torch.log2(codes.abs().clamp(min=2**-6))) - 3)
    else:
        step = torch.ones_like(codes)
    for got, cache in ((fused, written[1]), (one_token, written[2])):
        torch.testing.assert_close(got, expected, atol=4e-3, rtol=4e-3)
        assert ((cache - written[0]).abs() <= step * scale * 1.01 + 1e-3).all()


def test_gated_mlp_one_token_form_equals_the_general_form():
    mlp = _filled(GatedMLP(128, 192), seed=10).to(DEVICE, HALF)
    norm = _filled(RMSNorm(128, eps=1e-6), seed=11).to(DEVICE, HALF)
    residual = torch.randn(1, 128, device=DEVICE).to(HALF)
    with torch.inference_mode():
        expected = residual + mlp(norm(residual))
        got = residual.clone()
        mlp.add_one_token(got, norm)
    torch.testing.assert_close(got, expected, **HALF_TOLERANCE)


def test_attention_partials_come_from_the_backend_and_the_o_projection_reads_any_layout():
    """Split partials are the Triton backend's (the torch reference has none); the o projection
    reads them through their strides, so another layout of the same values gives the same
    result."""
    from tests.kernels.test_attention_kernels import make_batch, random_query

    assert get_attention_backend("torch").decode_partials is None
    backend = get_attention_backend("triton", DEVICE)
    k_cache, v_cache, meta = make_batch(
        [1], [150], num_kv_heads=2, head_dim=32, tokens_per_block=16, dtype=HALF, seed=3
    )
    query = random_query(1, 4, 32, dtype=HALF)
    partials = backend.decode_partials(query, k_cache, v_cache, meta, 0.2)
    assert (
        isinstance(partials, SplitPartials) and partials.num_heads == 4 and partials.head_dim == 32
    )
    # The same values stored split-major ([1, splits, heads, D]) and viewed head-major.
    outputs = partials.outputs.transpose(1, 2).contiguous().transpose(1, 2)
    lse = partials.lse.transpose(1, 2).contiguous().transpose(1, 2)
    assert outputs.stride() != partials.outputs.stride()
    o_proj = _filled(Linear(128, 64), seed=12).to(DEVICE, HALF)
    merged = backend.paged_attention(query, k_cache, v_cache, meta, 0.2).reshape(1, 128)
    with torch.inference_mode():
        expected = o_proj(merged)
        for layout in (partials, SplitPartials(outputs, lse)):
            torch.testing.assert_close(o_proj.one_token(layout), expected, **HALF_TOLERANCE)

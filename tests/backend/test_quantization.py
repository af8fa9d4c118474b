"""Weight formats (engine parameter `quantization`): int8_wo and fp8 quantized at load, AWQ, GPTQ
and FP8 checkpoints loaded as they are stored (built here from tiny random Llamas by
tests/quantized_checkpoints.py). Each layer holds exactly what its checkpoint or quantizer gives,
the lm_head stays float unless `quantize_lm_head` (then a tied head gets its own quantized copy),
and the engine's greedy tokens equal those of a plain model holding the de-quantized weights (for
fp8: of the same weights quantized at load)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from backend.attention import get_attention_backend
from backend.config import EngineConfig
from backend.layers import Linear
from backend.loading.model_loader import LoadSpec, load_model, weight_bytes
from backend.quantization import Fp8Weight, Int4Weight, Int8Weight
from backend.quantization.fp8 import quantize_rows
from backend.weight_formats import declared_quantization, pick_quantization
from tests.backend.test_engine_fidelity import serve
from tests.quantized_checkpoints import (
    dequantized_checkpoint,
    quantized_checkpoint,
    rewritten_checkpoint,
)
from tests.tiny_models import random_prompts

CPU = torch.device("cpu")
WIDE = dict(hidden_size=128, intermediate_size=256)  # K of every projection: 128 or 256
PROMPTS = random_prompts(6, 640, seed=3, high=40)


def _load(model_dir, quantization="none"):
    attention = get_attention_backend("torch", CPU)
    return load_model(
        LoadSpec(str(model_dir), CPU, torch.float32, attention, 256, quantization=quantization)
    )


def _tokens(model_dir, quantization="none", **config) -> list[list[int]]:
    results, _ = serve(model_dir, PROMPTS, 16, ignore_end_id=True, quantization=quantization)
    assert not any(r["error"] for r in results)
    return [r["token_ids"] for r in results]


def _projections(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head"}


def test_int8_wo_quantizes_every_projection_at_load(tiny_hf_model):
    _, directory = tiny_hf_model("llama", **WIDE)
    dense, kept = _load(directory), _load(directory, "int8_wo")
    for name, layer in _projections(kept).items():
        assert isinstance(layer.quantized, Int8Weight)
        expected = Int8Weight.quantize(dense.get_submodule(name).weight)
        assert torch.equal(layer.quantized.qweight, expected.qweight)
        assert torch.equal(layer.dense_weight(torch.float32), expected.dequantize(torch.float32))
        error = (layer.dense_weight(torch.float32) - dense.get_submodule(name).weight).abs()
        assert error.max() <= layer.quantized.scales.max() / 2 + 1e-7  # round to nearest
    assert kept.lm_head.quantized is None and torch.equal(kept.lm_head.weight, dense.lm_head.weight)
    assert weight_bytes(kept) < 0.6 * weight_bytes(dense)


def test_int8_wo_engine_equals_the_dequantized_model(tiny_hf_model, tmp_path):
    _, directory = tiny_hf_model("llama", **WIDE)
    plain = rewritten_checkpoint(
        directory,
        tmp_path / "int8-dequantized",
        lambda w: Int8Weight.quantize(w).dequantize(w.dtype),
    )
    quantized = _tokens(directory, "int8_wo")
    assert quantized == _tokens(plain)
    assert len({tuple(t) for t in quantized}) > 1  # real, prompt-dependent continuations


CHECKPOINTS = {
    "awq-g128": ("awq", 128, {}),
    "awq-g64": ("awq", 64, {}),
    "gptq-g128-sym": ("gptq", 128, {}),
    "gptq-g64-asym": ("gptq", 64, {"symmetric": False}),
    "gptq-g128-asym-v2": ("gptq", 128, {"symmetric": False, "checkpoint_format": "gptq_v2"}),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_int4_checkpoint_engine_equals_the_dequantized_model(case, tiny_hf_model, tmp_path):
    method, group, options = CHECKPOINTS[case]
    _, directory = tiny_hf_model("llama", **WIDE)
    checkpoint = quantized_checkpoint(directory, tmp_path / case, method, group, **options)
    plain = dequantized_checkpoint(checkpoint, tmp_path / f"{case}-dequantized")
    quantization = {"awq": "int4_awq", "gptq": "int4_gptq"}[method]
    assert declared_quantization(checkpoint) == quantization

    kept, dense = _load(checkpoint, "auto"), _load(plain)
    for name, layer in _projections(kept).items():
        assert isinstance(layer.quantized, Int4Weight) and layer.quantized.group_size == group
        assert torch.equal(layer.dense_weight(torch.float32), dense.get_submodule(name).weight)
    assert torch.equal(kept.lm_head.weight, dense.lm_head.weight)
    assert weight_bytes(kept) < 0.55 * weight_bytes(dense)

    tokens = _tokens(checkpoint, quantization)
    assert tokens == _tokens(plain)
    assert len({tuple(t) for t in tokens}) > 1


def test_awq_checkpoint_with_biases_and_tied_embeddings(tiny_hf_model, tmp_path):
    """Qwen2: q, k, v biases (stored beside the packed tensors) and a tied lm_head."""
    _, directory = tiny_hf_model("qwen2", tie_word_embeddings=True, **WIDE)
    checkpoint = quantized_checkpoint(directory, tmp_path / "awq", "awq", 64)
    plain = dequantized_checkpoint(checkpoint, tmp_path / "dequantized")
    kept = _load(checkpoint, "int4_awq")
    attention = kept.model.layers[0].self_attn.qkv_proj
    assert isinstance(attention.quantized, Int4Weight) and attention.bias is not None
    assert torch.equal(attention.bias, _load(plain).model.layers[0].self_attn.qkv_proj.bias)
    assert _tokens(checkpoint, "int4_awq") == _tokens(plain)


def test_fp8_checkpoint_loads_its_weights_and_scales(tiny_hf_model, tmp_path):
    """Per-channel scales for most projections, one per tensor for k and down (expanded to
    channels), static input scales ignored (activations are scaled per token)."""
    _, directory = tiny_hf_model("llama", **WIDE)
    checkpoint = quantized_checkpoint(
        directory, tmp_path / "fp8", "fp8", per_tensor=("k_proj", "down_proj"), input_scale=True
    )
    assert declared_quantization(checkpoint) == "fp8"
    kept, dense = _load(checkpoint, "auto"), _load(directory)
    layer = kept.model.layers[1].self_attn.qkv_proj.quantized
    assert isinstance(layer, Fp8Weight)
    q, k, v = layer.scales.split([128, 64, 64])
    assert len(set(k.tolist())) == 1 and len(set(q.tolist())) == 128
    for name, module in _projections(kept).items():
        weight = dense.get_submodule(name).weight
        error = (module.dense_weight(torch.float32) - weight).abs().max()
        assert error <= weight.abs().max() / 8  # e4m3: 3 mantissa bits
    assert torch.equal(kept.lm_head.weight, dense.lm_head.weight)


def test_fp8_checkpoint_engine_equals_fp8_quantized_at_load(tiny_hf_model, tmp_path):
    """The checkpoint holds what quantizing at load makes (per-channel scales): same tokens."""
    _, directory = tiny_hf_model("llama", **WIDE)
    checkpoint = quantized_checkpoint(directory, tmp_path / "fp8", "fp8")
    tokens = _tokens(checkpoint, "fp8")
    assert tokens == _tokens(directory, "fp8")
    assert len({tuple(t) for t in tokens}) > 1


def test_fp8_product_is_per_token_quantized_activations_times_dequantized_weights():
    torch.manual_seed(0)
    weight, x = Fp8Weight.quantize(torch.randn(48, 96)), torch.randn(5, 96)
    x[2] *= 1000  # one token's scale does not touch the others'
    xq, x_scales = quantize_rows(x)
    assert x_scales.shape == (5, 1) and xq.dtype == torch.float8_e4m3fn
    reference = F.linear(xq.float() * x_scales, weight.dequantize(torch.float32))
    got = weight.matmul(x)
    scale = reference.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(got, reference, rtol=1e-3, atol=0)
    assert torch.equal(weight.matmul(x[:2]), got[:2])
    exact = F.linear(x, weight.dequantize(torch.float32))
    assert ((got - exact).abs() / scale).max() < 0.05  # activation quantization error, e4m3


def test_pick_quantization_rules(tiny_hf_model, tmp_path):
    _, directory = tiny_hf_model("llama", **WIDE)
    awq = quantized_checkpoint(directory, tmp_path / "awq", "awq", 128)
    assert pick_quantization("auto", str(directory)) == "none"
    assert pick_quantization("int8_wo", str(directory)) == "int8_wo"
    assert pick_quantization("fp8", str(directory)) == "fp8"
    assert pick_quantization("auto", awq) == pick_quantization("int4_awq", awq) == "int4_awq"
    with pytest.raises(ValueError, match="quantization 'int4_awq' needs a checkpoint whose"):
        pick_quantization("int4_awq", str(directory))
    with pytest.raises(ValueError, match="declares 'int4_awq': use 'auto' or 'int4_awq'"):
        pick_quantization("int8_wo", awq)
    with pytest.raises(ValueError, match="declares 'int4_awq'"):
        pick_quantization("none", awq)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    _set_quantization_config(awq, quant_method="bitsandbytes")
    with pytest.raises(ValueError, match="quant_method must be one of .* got 'bitsandbytes'"):
        pick_quantization("auto", awq)


def test_unsupported_checkpoint_variants_are_refused_by_name(tiny_hf_model, tmp_path):
    _, directory = tiny_hf_model("llama", **WIDE)
    gptq = quantized_checkpoint(directory, tmp_path / "gptq", "gptq", 64)
    path = f"{gptq}/model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    tensors["model.layers.0.mlp.down_proj.g_idx"] = g_idx.flip(0).contiguous()  # desc_act order
    save_file(tensors, path)
    with pytest.raises(ValueError, match="g_idx must assign input channel k to group k // group"):
        _load(gptq, "auto")
    fp8 = quantized_checkpoint(directory, tmp_path / "fp8", "fp8")
    _set_quantization_config(fp8, weight_block_size=[128, 128])
    with pytest.raises(ValueError, match="weight_block_size .* are not supported"):
        _load(fp8, "auto")
    awq = quantized_checkpoint(directory, tmp_path / "awq", "awq", 64)
    _set_quantization_config(awq, version="gemv")
    with pytest.raises(ValueError, match="AWQ checkpoints must be version 'gemm'"):
        _load(awq, "auto")


def _set_quantization_config(model_dir, **values) -> None:
    with open(f"{model_dir}/config.json") as f:
        config = json.load(f)
    config["quantization_config"].update(values)
    with open(f"{model_dir}/config.json", "w") as f:
        json.dump(config, f)


def test_packed_layouts_are_the_formats_words():
    """Eight values 0..7 in one word, as each format's spec places them: AWQ interleaves them
    (nibble p holds value AWQ_ORDER[p]), GPTQ packs input channels in order, and GPTQ's
    symmetric zero point 8 is stored minus one (0x77777777)."""
    from backend.quantization.int4_packing import awq_values, gptq_values, pack_awq, pack_gptq

    row = torch.arange(8, dtype=torch.int16)
    qweight, qzeros = pack_awq(row[None, :], row[None, :])  # q [K=1, N=8]
    assert qweight.item() == qzeros.item() == 0x75316420
    assert torch.equal(awq_values(qweight, qzeros)[0], row[None, :])
    qweight, qzeros = pack_gptq(row[:, None], torch.full((1, 8), 8, dtype=torch.int16))
    assert qweight.item() == 0x76543210 and qzeros.item() == 0x77777777
    q, z = gptq_values(qweight, qzeros)
    assert torch.equal(q, row[:, None]) and torch.equal(z, torch.full((1, 8), 8))
    assert pack_gptq(row[:, None], torch.full((1, 8), 8), zeros_minus_one=False)[1].item() == (
        0x88888888 - 2**32
    )


def test_building_a_repository_checks_the_format_first(tiny_hf_model, tmp_path, capsys):
    from backend.loading.model_paths import check_quantization
    from ensemble.__main__ import main

    _, directory = tiny_hf_model("llama", **WIDE)
    argv = ["build", "--model", str(directory)]
    with pytest.raises(SystemExit):
        main(argv + ["--out", str(tmp_path / "awq"), "--quantization", "int4_awq"])
    assert "quantization 'int4_awq' needs a checkpoint whose" in capsys.readouterr().err
    assert not (tmp_path / "awq").exists()
    assert main(argv + ["--out", str(tmp_path / "int8"), "--quantization", "int8_wo"]) == 0
    for quantization in ("none", "auto", "gguf", "int8_wo", "fp8"):
        check_quantization("default", quantization)
    with pytest.raises(
        ValueError,
        match="'int4_gptq' needs a checkpoint whose config.json declares it .*"
        "'default' is not a checkpoint directory",
    ):
        check_quantization("default", "int4_gptq")


def test_int4_wo_rounds_every_projection_to_nearest_at_load(tiny_hf_model, tmp_path):
    _, directory = tiny_hf_model("llama", hidden_size=96, intermediate_size=256)
    dense, kept = _load(directory), _load(directory, "int4_wo")
    groups = set()
    for name, layer in _projections(kept).items():
        weight = dense.get_submodule(name).weight
        assert isinstance(layer.quantized, Int4Weight)
        groups.add(layer.quantized.group_size)
        step = layer.quantized.scales.float().repeat_interleave(layer.quantized.group_size, 1)
        error = (layer.dense_weight(torch.float32) - weight).abs()
        # round to nearest: half a step, a whole one where a group's zero point was rounded
        assert (error <= step + 1e-6).all() and (error / step).mean() < 0.3
    assert groups == {32, 128}  # 96 wide inputs take 32, the 256 wide down projection 128
    assert kept.lm_head.quantized is None
    plain = rewritten_checkpoint(
        directory,
        tmp_path / "int4-dequantized",
        lambda w: Int4Weight.quantize(w).dequantize(w.dtype),
    )
    assert _tokens(directory, "int4_wo") == _tokens(plain)


def test_a_bfloat16_model_keeps_4bit_scales_whose_products_are_its_dequantized_weights(
    tiny_hf_model,
):
    """A bfloat16 model's 4-bit scales are rounded to bfloat16 at load, so (q - z) * scale in
    bfloat16 (the GPU GEMM's paired multiply) rounds once, to the de-quantized weight; the 4-bit
    values and zero points are those of rounding the weights to nearest."""
    _, directory = tiny_hf_model("llama", **WIDE)
    attention = get_attention_backend("torch", CPU)
    dense, rounded = (
        load_model(
            LoadSpec(str(directory), CPU, torch.bfloat16, attention, 256, quantization=quantization)
        )
        for quantization in ("none", "int4_wo")
    )
    changed = 0
    for name, layer in _projections(rounded).items():
        weight = layer.quantized
        fresh = Int4Weight.quantize(dense.get_submodule(name).weight)  # float16 scales
        assert torch.equal(weight.qweight, fresh.qweight) and torch.equal(weight.zeros, fresh.zeros)
        assert torch.equal(weight.scales, fresh.scales.to(torch.bfloat16).to(torch.float16))
        changed += int(not torch.equal(weight.scales, fresh.scales))
        g = weight.group_size
        q_minus_z = weight.values() - weight.zeros.to(torch.int16).repeat_interleave(g, 1)
        scales = weight.scales.repeat_interleave(g, 1).to(torch.bfloat16)
        assert torch.equal(q_minus_z.to(torch.bfloat16) * scales, weight.dequantize(torch.bfloat16))
    assert changed == len(_projections(rounded))


def test_excluded_projections_stay_float_and_the_rest_is_quantized(tiny_hf_model, tmp_path):
    _, directory = tiny_hf_model("llama", **WIDE)
    attention = get_attention_backend("torch", CPU)
    dense = _load(directory)
    kept = load_model(
        LoadSpec(
            str(directory),
            CPU,
            torch.float32,
            attention,
            256,
            quantization="fp8",
            exclude=("layers.0.", "down_proj"),
        )
    )
    for name, layer in _projections(kept).items():
        if "layers.0." in name or "down_proj" in name:
            assert layer.quantized is None
            assert torch.equal(layer.weight, dense.get_submodule(name).weight)
        else:
            assert isinstance(layer.quantized, Fp8Weight), name
    # The engine parameter reaches the loader: excluding every layer gives the float tokens.
    every_layer = ",".join(f"layers.{i}." for i in range(len(kept.model.layers)))
    results, _ = serve(
        directory,
        PROMPTS,
        16,
        ignore_end_id=True,
        quantization="fp8",
        quantization_exclude=every_layer,
    )
    assert [r["token_ids"] for r in results] == _tokens(directory)


@pytest.mark.parametrize(
    "exclude, quantization, message",
    [
        ("layers.99.", "fp8", "['layers.99.'] match no projection"),
        ("layers.0.", "none", "these weights are not quantized"),
        ("layers.0.,", "fp8", "fragments of module names separated by commas"),
    ],
)
def test_quantization_exclude_refusals_name_the_rule(tiny_hf_model, exclude, quantization, message):
    _, directory = tiny_hf_model("llama", **WIDE)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        serve(directory, PROMPTS[:1], 2, quantization=quantization, quantization_exclude=exclude)


@pytest.mark.parametrize("quantization, kind", [("int8_wo", Int8Weight), ("fp8", Fp8Weight)])
def test_quantize_lm_head_gives_a_tied_head_its_own_copy(tiny_hf_model, quantization, kind):
    _, directory = tiny_hf_model("llama", tie_word_embeddings=True, **WIDE)
    dense = _load(directory)
    attention = get_attention_backend("torch", CPU)
    kept = load_model(
        LoadSpec(
            str(directory),
            CPU,
            torch.float32,
            attention,
            256,
            quantization=quantization,
            quantize_lm_head=True,
        )
    )
    head = kept.lm_head.quantized
    assert isinstance(head, kind) and kept.lm_head.weight is None
    assert torch.equal(head.qweight, kind.quantize(dense.lm_head.weight).qweight)
    # The embedding looks rows up in its float table, untouched.
    assert torch.equal(kept.model.embed_tokens.weight, dense.model.embed_tokens.weight)
    hidden = torch.randn(3, WIDE["hidden_size"])
    expected = head.matmul(dense.model.norm(hidden))
    assert torch.equal(kept.compute_logits(hidden), expected.float())


def test_int8_wo_with_quantized_lm_head_equals_the_dequantized_model(tiny_hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    _, directory = tiny_hf_model("llama", **WIDE)
    dequantize = lambda w: Int8Weight.quantize(w).dequantize(w.dtype)  # noqa: E731
    plain = rewritten_checkpoint(directory, tmp_path / "int8-dequantized", dequantize)
    tensors = load_file(f"{plain}/model.safetensors")
    tensors["lm_head.weight"] = dequantize(tensors["lm_head.weight"])
    save_file(tensors, f"{plain}/model.safetensors", metadata={"format": "pt"})
    results, _ = serve(
        directory, PROMPTS, 16, ignore_end_id=True, quantization="int8_wo", quantize_lm_head=True
    )
    quantized = [r["token_ids"] for r in results]
    assert quantized == _tokens(plain)
    assert quantized != _tokens(directory, "int8_wo")  # the head's rounding shows


def test_fp8_fast_accumulation_reaches_every_fp8_weight(tiny_hf_model):
    """The engine parameter marks every fp8 projection and the fp8 head; refused for formats
    without fp8 weights, naming the field."""
    _, directory = tiny_hf_model("llama", **WIDE)
    attention = get_attention_backend("torch", CPU)
    spec = LoadSpec(
        str(directory),
        CPU,
        torch.float32,
        attention,
        256,
        quantization="fp8",
        quantize_lm_head=True,
    )
    plain = load_model(spec)
    assert not any(getattr(m, "fast_accumulation", False) for m in plain.modules())
    fast = load_model(dataclasses.replace(spec, fp8_fast_accumulation=True))
    weights = [m for m in fast.modules() if isinstance(m, Fp8Weight)]
    assert len(weights) == 9  # qkv, o, gate|up and down of each of 2 layers, and the head
    assert all(w.fast_accumulation for w in weights)
    with pytest.raises(
        ValueError, match="fp8_fast_accumulation applies to fp8 weights .* 'int8_wo'"
    ):
        EngineConfig(quantization="int8_wo", fp8_fast_accumulation=True)


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_quantize_lm_head_is_refused_without_a_quantized_format(quantization):
    with pytest.raises(
        ValueError, match=f"quantize_lm_head needs .* got quantization '{quantization}'"
    ):
        EngineConfig(quantization=quantization, quantize_lm_head=True)

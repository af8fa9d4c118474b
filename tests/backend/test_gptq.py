"""GPTQ (backend/quantization/gptq.py, calibrated by backend/tools/gptq_calibration.py): without
input correlations it is round to nearest; with them it leaves a layer's outputs closer than round
to nearest does; its checkpoint loads as int4_gptq, and the engine serves exactly the de-quantized
weights it wrote."""

from __future__ import annotations

import pytest
import torch

from backend.loading.model_paths import resolve_model
from backend.quantization import Fp8Weight
from backend.quantization.gptq import gptq_fp8, gptq_quantize, write_gptq_checkpoint
from backend.quantization.int4_packing import dequantize_groups as dequantize
from backend.quantization.int4_packing import quantize_groups
from backend.tools.calibration import calibration_prompts
from backend.tools.gptq_calibration import calibrate, main
from backend.weight_formats import declared_quantization
from benchmarks import quality_corpus
from preprocessing.tokenizer import load_tokenizer
from tests.backend.test_quantization import WIDE, _load, _projections, _tokens
from tests.quantized_checkpoints import dequantized_checkpoint
from tests.tiny_models import random_prompts
from tests.tokenizer_fixtures import copy_sentencepiece_tokenizer


def output_error(weight, approx, hessian) -> float:
    """Mean squared change of the layer's outputs over the inputs whose products are H."""
    delta = (weight - approx).double()
    return torch.trace(delta @ hessian.double() @ delta.t()).item()


def correlated_layer(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [64, 128] and the H of inputs whose channels are correlated and uneven."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(128, 128, generator=gen) * torch.linspace(0.1, 3.0, 128)
    inputs = torch.randn(2048, 128, generator=gen) @ mixing
    hessian = inputs.t() @ inputs / inputs.shape[0]
    return torch.randn(64, 128, generator=gen) * 0.05, hessian


def test_without_input_correlations_gptq_is_round_to_nearest():
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    gptq = gptq_quantize(weight, torch.eye(128), 64, act_order=False, clip_search=False)
    for ours, rtn in zip(gptq, quantize_groups(weight, 64)):
        assert torch.equal(ours, rtn)


def test_gptq_changes_the_outputs_less_than_round_to_nearest():
    weight, hessian = correlated_layer(seed=1)
    rtn = output_error(weight, dequantize(*quantize_groups(weight, 64), 64), hessian)
    errors = {}
    for act_order in (False, True):
        for clip_search in (False, True):
            approx = dequantize(*gptq_quantize(weight, hessian, 64, act_order, clip_search), 64)
            errors[act_order, clip_search] = output_error(weight, approx, hessian) / rtn
            # each weight stays within its group's range: the columns went back in their order
            assert (approx - weight).abs().max() < 0.5 * weight.abs().max()
    assert errors[False, False] < 0.8  # measured 0.73
    assert errors[True, False] < 0.5 * errors[False, False]  # heavy inputs first: 0.34
    assert errors[True, True] <= errors[True, False]  # ranges shrunk where it pays: 0.33


def test_a_calibrated_checkpoint_loads_as_gptq_and_serves_its_values(tiny_hf_model, tmp_path):
    _, directory = tiny_hf_model("llama", **WIDE)
    hessians, targets = calibrate(directory, random_prompts(8, 500, seed=4, low=40, high=60), 128)
    projections = _projections(_load(directory))
    assert set(hessians) == set(projections)  # one H per layer's input, fused layers once
    checkpoint = tmp_path / "gptq"
    assert write_gptq_checkpoint(str(directory), str(checkpoint), hessians, targets, 64) == 2 * 7
    assert declared_quantization(checkpoint) == "int4_gptq"
    plain = dequantized_checkpoint(checkpoint, tmp_path / "gptq-dequantized")
    dense, kept = _load(directory), _load(checkpoint, "int4_gptq")
    for name, layer in _projections(kept).items():
        served = layer.dense_weight(torch.float32)
        weight = dense.get_submodule(name).weight
        rows = [dequantize(*quantize_groups(part, 64), 64) for part in _parts(layer, weight)]
        assert output_error(weight, served, hessians[name]) < output_error(
            weight, torch.cat(rows), hessians[name]
        )
    assert _tokens(checkpoint, "int4_gptq") == _tokens(plain)


def _parts(layer, weight: torch.Tensor) -> list[torch.Tensor]:
    """A fused layer's weight cut into its projections (each quantized on its own)."""
    if layer.shards is None:
        return [weight]
    return [weight[first : first + rows] for first, rows in layer.shards.values()]


def test_fp8_gptq_changes_the_outputs_less_than_rounding_each_weight():
    weight, hessian = correlated_layer(seed=2)
    plain = Fp8Weight.quantize(weight)
    values, scales = gptq_fp8(weight, hessian)
    assert values.dtype == plain.qweight.dtype and torch.equal(scales, plain.scales)
    calibrated = values.float() * scales[:, None]
    rounded = plain.dequantize(torch.float32)
    assert output_error(weight, calibrated, hessian) < 0.5 * output_error(weight, rounded, hessian)


def test_an_fp8_checkpoint_keeps_the_excluded_layers_float(tiny_hf_model, tmp_path):
    _, directory = tiny_hf_model("llama", **WIDE)
    hessians, targets = calibrate(directory, random_prompts(4, 500, seed=5, low=40, high=60), 128)
    checkpoint = tmp_path / "fp8"
    written = write_gptq_checkpoint(
        str(directory), str(checkpoint), hessians, targets, 64, "fp8", ("layers.1.",)
    )
    assert written == 7  # layer 0's projections; layer 1's stay float
    assert declared_quantization(checkpoint) == "fp8"
    dense, kept = _load(directory), _load(checkpoint, "fp8")
    for name, layer in _projections(kept).items():
        weight = dense.get_submodule(name).weight
        if "layers.1." in name:
            assert layer.quantized is None and torch.equal(layer.weight, weight)
        else:
            values, scales = (
                torch.cat(t)
                for t in zip(*[gptq_fp8(p, hessians[name]) for p in _parts(layer, weight)])
            )
            assert torch.equal(layer.quantized.qweight, values)
            assert torch.equal(layer.quantized.scales, scales)
    with pytest.raises(ValueError, match="match no projection"):
        write_gptq_checkpoint(
            str(directory), str(tmp_path / "x"), hessians, targets, 64, "fp8", ("nope",)
        )
    assert _tokens(checkpoint, "fp8")  # it serves


def test_the_command_line_writes_the_asked_format_and_keeps_the_excluded_layers(
    tiny_hf_model, tmp_path
):
    """`python -m backend.tools.gptq_calibration` passes --weights and --exclude on (it once wrote a
    4-bit checkpoint whatever --weights said)."""
    _, directory = tiny_hf_model("llama", vocab_size=700, **WIDE)
    copy_sentencepiece_tokenizer(directory)  # under 700 tokens
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 40)
    out = tmp_path / "fp8"
    main(
        [
            *("--model", str(directory), "--calibration", str(text), "--out", str(out)),
            *("--weights", "fp8", "--exclude", "layers.1.", "--num-windows", "2", "--window", "32"),
        ]
    )
    assert declared_quantization(out) == "fp8"
    for name, layer in _projections(_load(out, "fp8")).items():
        assert (layer.quantized is None) == ("layers.1." in name), name
        if layer.quantized is not None:
            assert isinstance(layer.quantized, Fp8Weight), name


@pytest.mark.slow
def test_act_order_with_static_groups_helps_on_a_real_layer():
    """The default model's down_proj of layer 5 over calibration text: the columns rounded
    heaviest first (the groups' grids set beforehand, in plain order) leave less output error
    than rounding them in order."""
    model_dir = resolve_model("default")
    text = quality_corpus.CALIBRATION.read_text()
    prompts = calibration_prompts(load_tokenizer(model_dir), text, 4, 256)
    hessians, _ = calibrate(str(model_dir), prompts, 264)
    name = "model.layers.5.mlp.down_proj"
    weight = _load(model_dir).get_submodule(name).weight.detach()
    hessian = hessians[name]
    errors = {}
    for act_order in (False, True):
        approx = dequantize(*gptq_quantize(weight, hessian, 64, act_order, False), 64)
        errors[act_order] = output_error(weight, approx, hessian)
    rtn = output_error(weight, dequantize(*quantize_groups(weight, 64), 64), hessian)
    assert errors[False] < 0.5 * rtn  # measured 0.15
    assert errors[True] < 0.75 * errors[False]  # 0.094 of round to nearest: 0.62

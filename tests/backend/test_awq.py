"""AWQ (backend/quantization/awq.py, awq_checkpoint.py, calibrated by
backend/tools/awq_calibration.py): folding the scales leaves the float model as it was (the default
model; Gemma 3's (1 + w) norms
and one kv head for four query heads), the scale search never does worse than round to nearest
on the layer it measures, and the written checkpoint loads as int4_awq and scores the
calibration text better than the round-to-nearest one."""

from __future__ import annotations

import math

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.loading.model_paths import resolve_model
from backend.model_config import ModelConfig
from backend.quantization.awq import output_error, search_scales
from backend.quantization.awq_checkpoint import (
    load_tensors,
    scale_checkpoint,
    write_awq_checkpoint,
)
from backend.quantization.checkpoint_writer import write_checkpoint
from backend.quantization.int4_packing import dequantize_groups, quantize_groups
from backend.sampling_params import SamplingParams
from backend.tools.awq_calibration import main
from backend.tools.calibration import calibrate, calibration_prompts
from backend.weight_formats import declared_quantization
from benchmarks import quality_corpus
from preprocessing.tokenizer import load_tokenizer
from tests.quantized_checkpoints import quantized_checkpoint
from tests.tiny_models import random_prompts
from tests.tokenizer_fixtures import copy_sentencepiece_tokenizer

ALPHAS = (0.5,)  # no search: these tests check the folding and the format, not alpha


def prompt_logprobs(model_dir, prompts, quantization="none") -> list[list[float]]:
    config = EngineConfig(
        model_path=str(model_dir),
        device="cpu",
        quantization=quantization,
        max_seq_len=300,
        max_tokens_in_paged_kv_cache=4096,  # not sized from free memory: starts in a second
    )
    executor = Executor(config)
    try:
        params = SamplingParams(max_tokens=1, return_prompt_log_probs=True)
        results = executor.generate(prompts, params, timeout=600)
    finally:
        executor.shutdown()
    assert not any(r["error"] for r in results)
    return [r["prompt_logprobs"][1:] for r in results]


def scaled_copy(model_dir, out_dir, prompts, group_size: int):
    """The float checkpoint with AWQ's scales applied (searched on `prompts`)."""
    inputs, targets = calibrate(str(model_dir), prompts, max_seq_len=256)
    config = ModelConfig.from_dir(str(model_dir))
    tensors = load_tensors(model_dir)
    scaled = scale_checkpoint(tensors, inputs, targets, config, group_size, ALPHAS)
    write_checkpoint(str(model_dir), str(out_dir), scaled.tensors, None)
    return tensors, scaled


def assert_same_outputs(model_dir, scaled_dir, prompts):
    for ours, theirs in zip(
        prompt_logprobs(scaled_dir, prompts), prompt_logprobs(model_dir, prompts)
    ):
        assert ours == pytest.approx(theirs, abs=2e-4)


@pytest.mark.slow
def test_folded_scales_leave_the_default_model_unchanged(tmp_path):
    model_dir = resolve_model("default")
    prompts = random_prompts(4, 49152, seed=1, low=40, high=80)
    tensors, scaled = scaled_copy(model_dir, tmp_path / "scaled", prompts, 64)
    layer = "model.layers.3."
    for name in ("input_layernorm", "post_attention_layernorm", "mlp.up_proj", "self_attn.v_proj"):
        assert not torch.allclose(
            scaled.tensors[f"{layer}{name}.weight"], tensors[f"{layer}{name}.weight"]
        )
    spread = [s.max() / s.min() for s in scaled.input_scales.values()]
    assert min(spread) > 1.5  # every group's channels scaled unevenly
    assert_same_outputs(model_dir, tmp_path / "scaled", prompts)


def test_folded_scales_leave_gemma3_unchanged(tiny_hf_model, tmp_path):
    """(1 + w) norms, the norm before the MLP that Gemma 2/3 add, one kv head for four query
    heads (o's scales repeated over them)."""
    _, directory = tiny_hf_model("gemma3_text", hidden_size=128, intermediate_size=256)
    prompts = random_prompts(4, 640, seed=2, low=30, high=60)
    tensors, scaled = scaled_copy(directory, tmp_path / "scaled", prompts, 32)
    o_scales = scaled.input_scales["model.layers.0.self_attn.o_proj"].view(4, 32)
    assert torch.equal(o_scales, o_scales[:1].expand(4, -1))
    assert not torch.allclose(o_scales, torch.ones_like(o_scales))
    assert_same_outputs(directory, tmp_path / "scaled", prompts)


def test_the_search_does_no_worse_than_round_to_nearest_and_better_with_uneven_inputs():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen) * 0.05
    loud = torch.rand(256, generator=gen) ** 4 * 20 + 0.1  # a few channels carry most
    inputs = torch.randn(4096, 256, generator=gen) * loud
    hessian = inputs.t() @ inputs / inputs.shape[0]
    choice = search_scales(weight, hessian, inputs.abs().mean(dim=0), 128)
    rtn = dequantize_groups(*quantize_groups(weight, 128), 128)
    assert choice.rtn_error == pytest.approx(output_error(weight, rtn, hessian), rel=1e-5)
    assert 0 < choice.alpha and choice.error < 0.7 * choice.rtn_error


@pytest.mark.slow
def test_an_awq_checkpoint_loads_as_int4_awq_and_beats_round_to_nearest(tmp_path):
    model_dir = resolve_model("default")
    text = quality_corpus.CALIBRATION.read_text()
    prompts = calibration_prompts(load_tokenizer(model_dir), text, 4, 256)
    inputs, targets = calibrate(str(model_dir), prompts, max_seq_len=264)
    awq = tmp_path / "awq"
    write_awq_checkpoint(str(model_dir), str(awq), inputs, targets, 64, alphas=ALPHAS)
    assert declared_quantization(awq) == "int4_awq"
    rtn = quantized_checkpoint(model_dir, tmp_path / "rtn", "awq", 64)

    def nll(checkpoint, quantization="none") -> float:
        scores = prompt_logprobs(checkpoint, prompts, quantization)
        return -sum(map(sum, scores)) / sum(map(len, scores))

    base = nll(model_dir)
    gap_awq, gap_rtn = nll(awq, "int4_awq") - base, nll(rtn, "int4_awq") - base
    assert math.isfinite(gap_awq) and 0 < gap_awq < 0.6 * gap_rtn


def test_the_command_line_writes_an_awq_checkpoint_that_serves(tiny_hf_model, tmp_path):
    _, directory = tiny_hf_model("llama", vocab_size=700, hidden_size=128, intermediate_size=256)
    copy_sentencepiece_tokenizer(directory)  # under 700 tokens
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 40)
    out = tmp_path / "awq"
    main(
        [
            *("--model", str(directory), "--calibration", str(text), "--out", str(out)),
            *("--group-size", "64", "--rounding", "gptq", "--num-windows", "2", "--window", "32"),
        ]
    )
    assert declared_quantization(out) == "int4_awq"
    prompts = random_prompts(2, 700, seed=3, low=20, high=30)
    assert all(map(len, prompt_logprobs(out, prompts, "int4_awq")))

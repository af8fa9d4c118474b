"""Calibration inputs: text cut into token windows and run through the float model on the CPU,
with a hook on every projection's input that sums what a quantizer needs of it: the input
products H = X^T X (GPTQ's, backend/tools/gptq_calibration.py; AWQ's output error,
backend/tools/awq_calibration.py) and each input channel's mean magnitude (AWQ's scales). A fused
q|k|v or gate|up layer has one input, so one entry for its parts.
"""

from __future__ import annotations

import argparse

import torch

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.layers.linear import Linear
from backend.loading.model_paths import resolve_model
from backend.models.hf_weights import weight_targets
from backend.quantization.layer_inputs import LayerInputs
from backend.sampling_params import SamplingParams
from preprocessing.tokenizer import load_tokenizer

CACHED_WINDOWS = 16  # windows the KV cache holds at once


def calibration_prompts(tokenizer, text: str, num: int, length: int) -> list[list[int]]:
    """`num` windows of `length` tokens, evenly spread over the calibration text, each after
    the tokens the tokenizer puts before a text (gemma's <bos>, SmolLM2's none), as a served
    prompt starts: without its <bos> gemma's activations are not those it serves with."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < length:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than {length}")
    step = max((len(ids) - length) // max(num - 1, 1), 1)
    starts = range(0, len(ids) - length + 1, step)
    first = start_tokens(tokenizer)
    return [first + ids[s : s + length] for s in list(starts)[:num]]


def start_tokens(tokenizer) -> list[int]:
    """What the tokenizer puts before a text."""
    return list(tokenizer.encode(""))


def collect_inputs(executor, prompts: list[list[int]]) -> dict[str, LayerInputs]:
    """`LayerInputs` of every Linear (but the lm_head), by module name, over the prompts run
    through `executor` (a CPU Executor of the float model)."""
    products: dict[str, torch.Tensor] = {}
    magnitudes: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def observe(name: str):
        def hook(module, inputs) -> None:
            x = inputs[0].detach().reshape(-1, module.in_features).double()
            products[name] = products.get(name, 0) + x.t() @ x
            magnitudes[name] = magnitudes.get(name, 0) + x.abs().sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        return hook

    model = executor.runner.model
    handles = [
        module.register_forward_pre_hook(observe(name))
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "lm_head"
    ]
    try:
        executor.generate(prompts, SamplingParams(max_tokens=1))
    finally:
        for handle in handles:
            handle.remove()
    return {
        name: LayerInputs(products[name] / counts[name], magnitudes[name] / counts[name], n)
        for name, n in counts.items()
    }


def calibrate(
    float_dir: str, prompts: list[list[int]], max_seq_len: int
) -> tuple[dict[str, LayerInputs], dict]:
    """(`LayerInputs` of every layer over `prompts`, the Hugging Face names' targets
    (`weight_targets`)) of the float model in `float_dir`, run on the CPU in float32."""
    config = EngineConfig(
        model_path=str(float_dir),
        device="cpu",
        dtype="float32",
        max_seq_len=max_seq_len,
        max_tokens_in_paged_kv_cache=CACHED_WINDOWS * max_seq_len,  # not sized from free memory
        seed=0,
    )
    executor = Executor(config)
    try:
        return collect_inputs(executor, prompts), weight_targets(executor.runner.model)
    finally:
        executor.shutdown()


def calibrate_on_text(
    model: str, text: str, num: int, length: int
) -> tuple[str, dict[str, LayerInputs], dict]:
    """(the float checkpoint's directory, `calibrate`'s two results) of `model` (a name or a
    directory) over `num` windows of `length` tokens of `text`."""
    float_dir = resolve_model(model)
    prompts = calibration_prompts(load_tokenizer(float_dir), text, num, length)
    return (float_dir, *calibrate(float_dir, prompts, max_seq_len=length + 8))


def calibration_parser(doc: str, checkpoint: str) -> argparse.ArgumentParser:
    """The options every calibration command takes (model, text, output, windows); `doc` the
    module docstring, `checkpoint` what the output directory holds."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default, a preset, a HF dir or a .gguf")
    p.add_argument("--calibration", required=True, help="a text file to calibrate on")
    p.add_argument("--out", required=True, help=f"the {checkpoint} checkpoint's directory")
    p.add_argument("--num-windows", type=int, default=64, help="calibration windows")
    p.add_argument("--window", type=int, default=512, help="tokens per calibration window")
    return p


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()

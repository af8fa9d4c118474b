"""Which weight format serves a model: what a Hugging Face checkpoint declares (config.json's
`quantization_config`) and what the engine parameter `quantization` asks for. No torch: the
ensemble checks a setting with it before anything starts."""

from __future__ import annotations

import json
import os

# quantization_config.quant_method -> the `quantization` value that serves it
DECLARED = {"awq": "int4_awq", "gptq": "int4_gptq", "fp8": "fp8"}
# Formats quantized at load from a float checkpoint.
AT_LOAD = ("int8_wo", "int4_wo", "fp8")


def quantization_config(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("quantization_config")


def declared_quantization(model_dir: str) -> str:
    """The `quantization` value a directory's checkpoint declares: "none" for float weights."""
    config = quantization_config(model_dir)
    if config is None:
        return "none"
    method = config.get("quant_method")
    if method not in DECLARED:
        raise ValueError(
            f"quantization_config.quant_method must be one of {tuple(DECLARED)} in {model_dir}, "
            f"got {method!r}"
        )
    return DECLARED[method]


def pick_quantization(requested: str, model_dir: str) -> str:
    """The format to load `model_dir` in for the engine parameter `quantization` (not "gguf",
    which `backend.loading.model_paths.kept_gguf` handles): "auto" is what the checkpoint declares;
    int4_awq/int4_gptq need their checkpoint; int8_wo, int4_wo and fp8 quantize a float
    checkpoint at load; fp8 also loads an FP8 checkpoint. Raises ValueError naming the rule
    otherwise."""
    declared = declared_quantization(model_dir)
    if requested == "auto" or requested == declared:
        return declared
    if requested in AT_LOAD and declared == "none":
        return requested
    if declared == "none":
        method = next((m for m, q in DECLARED.items() if q == requested), requested)
        raise ValueError(
            f"quantization {requested!r} needs a checkpoint whose config.json declares it "
            f"(quantization_config.quant_method {method!r}); {model_dir} holds float weights: "
            f"use one of 'none', 'auto', {', '.join(map(repr, AT_LOAD))}"
        )
    raise ValueError(
        f"quantization {requested!r} does not match the checkpoint in {model_dir}, which "
        f"declares {declared!r}: use 'auto' or {declared!r}"
    )

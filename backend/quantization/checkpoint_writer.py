"""A quantized copy of a float Hugging Face checkpoint: each decoder projection's `weight`
replaced by a format's tensors, config.json given the `quantization_config` that such
checkpoints carry, the other files copied. What the GPTQ calibration writes
(backend/quantization/gptq.py, from backend/tools/gptq_calibration.py), and the round-to-nearest
checkpoints of the quality benchmark and the tests."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable

import torch

PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")

# (Hugging Face name, float weight) -> the tensors replacing it, by suffix (qweight, scales, ...)
LayerTensors = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def write_quantized_copy(
    src_dir, dst_dir, layer_tensors: LayerTensors, quantization_config: dict | None
) -> int:
    """Write the copy; returns how many projections were replaced."""
    tensors, count = replaced_projections(src_dir, layer_tensors)
    write_checkpoint(src_dir, dst_dir, tensors, quantization_config)
    return count


def replaced_projections(
    src_dir, layer_tensors: LayerTensors
) -> tuple[dict[str, torch.Tensor], int]:
    """The checkpoint's tensors with each decoder projection's weight replaced, and how many."""
    from safetensors.torch import load_file

    tensors, count = {}, 0
    for file in sorted(f for f in os.listdir(src_dir) if f.endswith(".safetensors")):
        for name, weight in load_file(os.path.join(src_dir, file)).items():
            if not PROJECTION.match(name):
                tensors[name] = weight
                continue
            prefix = name[: -len(".weight")]
            tensors.update({f"{prefix}.{k}": v for k, v in layer_tensors(name, weight).items()})
            count += 1
    return tensors, count


def write_checkpoint(
    src_dir, dst_dir, tensors: dict[str, torch.Tensor], quantization_config: dict | None
) -> str:
    """`tensors` as dst_dir's one model.safetensors (written whole before it takes its name),
    src_dir's other files beside it, its config.json with `quantization_config` (None: a float
    checkpoint)."""
    from safetensors.torch import save_file

    os.makedirs(dst_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src_dir, name), dst_dir)
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    if quantization_config is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tmp = os.path.join(dst_dir, "model.safetensors.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, os.path.join(dst_dir, "model.safetensors"))
    return str(dst_dir)

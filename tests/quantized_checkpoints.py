"""Quantized checkpoints in Hugging Face format, built from a float one (no AWQ, GPTQ or FP8
checkpoint can be downloaded here): every decoder projection's `weight` replaced by the format's
tensors (round to nearest: `backend.quantization.int4_packing`, `Fp8Weight.quantize`), config.json
given the `quantization_config` such checkpoints carry. The lm_head and embeddings stay float."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from backend.quantization.checkpoint_writer import write_checkpoint, write_quantized_copy
from backend.quantization.fp8 import Fp8Weight
from backend.quantization.int4_packing import (
    awq_tensors,
    awq_values,
    gptq_tensors,
    gptq_values,
    pack_words,
)


def _tensors(src_dir) -> dict[str, torch.Tensor]:
    (file,) = [f for f in os.listdir(src_dir) if f.endswith(".safetensors")]
    return load_file(os.path.join(src_dir, file))


def quantized_checkpoint(src_dir, dst_dir, method: str, group_size: int = 128, **options) -> str:
    """Write `method` ("awq", "gptq", "fp8") of the float checkpoint in src_dir to dst_dir.
    gptq options: symmetric (True), checkpoint_format ("gptq"); fp8: per_tensor (names whose
    scale is one number), input_scale (write static activation scales, which are not read)."""

    def layer_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if method == "awq":
            return awq_tensors(weight, group_size)
        if method == "gptq":
            layer = gptq_tensors(weight, group_size, options.get("symmetric", True))
            if options.get("checkpoint_format") == "gptq_v2":
                _, z = gptq_values(layer["qweight"], layer["qzeros"])
                layer["qzeros"] = pack_words(z)
            return layer
        layer = _fp8_tensors(weight, any(p in name for p in options.get("per_tensor", ())))
        if options.get("input_scale"):
            layer["input_scale"] = torch.tensor(0.5)
        return layer

    config = quantization_config(method, group_size, **options)
    write_quantized_copy(src_dir, dst_dir, layer_tensors, config)
    return str(dst_dir)


def _fp8_tensors(weight: torch.Tensor, per_tensor: bool) -> dict[str, torch.Tensor]:
    if per_tensor:
        scale = weight.abs().max().float() / 448
        return {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
    quantized = Fp8Weight.quantize(weight)
    return {"weight": quantized.qweight, "weight_scale": quantized.scales}


def quantization_config(method: str, group_size: int = 128, **options) -> dict:
    if method == "awq":
        return dict(
            quant_method="awq", bits=4, group_size=group_size, zero_point=True, version="gemm"
        )
    if method == "gptq":
        return dict(
            quant_method="gptq",
            bits=4,
            group_size=group_size,
            desc_act=False,
            sym=options.get("symmetric", True),
            checkpoint_format=options.get("checkpoint_format", "gptq"),
        )
    return dict(
        quant_method="fp8", activation_scheme="static" if options.get("input_scale") else "dynamic"
    )


def dequantized_checkpoint(quantized_dir, dst_dir) -> str:
    """The float checkpoint holding an AWQ/GPTQ checkpoint's de-quantized weights (float32)."""
    with open(os.path.join(quantized_dir, "config.json")) as f:
        config = json.load(f)["quantization_config"]
    group = config["group_size"]
    tensors, out = _tensors(quantized_dir), {}
    for name, tensor in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if f"{prefix}.qweight" not in tensors or suffix not in (
            "qweight",
            "qzeros",
            "scales",
            "g_idx",
        ):
            out[name] = tensor
        elif suffix == "qweight":
            qzeros, scales = tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"]
            if config["quant_method"] == "awq":
                q, z = awq_values(tensor, qzeros)
            else:
                q, z = gptq_values(tensor, qzeros, config["checkpoint_format"] == "gptq")
            w = (q - z.repeat_interleave(group, 0)).float()
            out[f"{prefix}.weight"] = (w * scales.float().repeat_interleave(group, 0)).t()
    return write_checkpoint(quantized_dir, dst_dir, out, None)


def rewritten_checkpoint(src_dir, dst_dir, rewrite) -> str:
    """The float checkpoint with every decoder projection's weight w replaced by rewrite(w)."""
    write_quantized_copy(src_dir, dst_dir, lambda _, w: {"weight": rewrite(w)}, None)
    return str(dst_dir)

"""Quantized weights into a model: float weights quantized at load (int8_wo, int4_wo, fp8), and
quantized Hugging Face checkpoints (AWQ, GPTQ, FP8; which one a directory holds:
backend/loading/weight_formats.py) loaded into `QuantizedWeight`s.

A quantized checkpoint names each quantized projection's tensors after it
(`model.layers.0.self_attn.q_proj.qweight`, `.qzeros`, `.scales`, ...), in place of `.weight`;
the lm_head, embeddings and norms are ordinary tensors. Each format converts one projection's
tensors into its `QuantizedWeight`'s buffers (output channels first), which then fill that
projection's rows of a fused q|k|v or gate|up layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from backend.layers.linear import Linear
from backend.quantization.base import QuantizedWeight
from backend.quantization.fp8 import FP8, Fp8Weight
from backend.quantization.int4 import Int4Weight
from backend.quantization.int4_packing import awq_values, gptq_values
from backend.quantization.int8 import Int8Weight

# Formats quantized at load from a float checkpoint (backend.loading.weight_formats.AT_LOAD).
QUANTIZERS = {
    "int8_wo": Int8Weight.quantize,
    "int4_wo": Int4Weight.quantize,
    "fp8": Fp8Weight.quantize,
}


def quantize_at_load(model: nn.Module, quantization: str, exclude: tuple[str, ...] = ()) -> int:
    """Replace the weight of every Linear except the lm_head, and those whose name holds one of
    the `exclude` fragments, by its `quantization` form (int8_wo, int4_wo, fp8); returns how many
    layers changed."""
    quantize = QUANTIZERS[quantization]
    count, matched = 0, set()
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.quantized is not None or name == "lm_head":
            continue
        hits = {fragment for fragment in exclude if fragment in name}
        if hits:
            matched |= hits
            continue
        module.set_quantized(quantize(module.weight))
        count += 1
    unmatched = [fragment for fragment in exclude if fragment not in matched]
    if unmatched:
        raise ValueError(
            f"quantization_exclude: {unmatched} match no projection of this model "
            "(fragments of module names such as 'layers.0.' or 'down_proj')"
        )
    return count


# The lm_head's quantizer per format (`quantize_lm_head`): checkpoints leave it float, so their
# formats round it at load too (4-bit: to nearest, groups of 128).
LM_HEAD_QUANTIZERS = {
    **QUANTIZERS,
    "int4_awq": Int4Weight.quantize,
    "int4_gptq": Int4Weight.quantize,
}


def quantize_lm_head(model: nn.Module, quantization: str) -> None:
    """Hold the lm_head in `quantization`'s form (one of LM_HEAD_QUANTIZERS: the loader refuses
    the others by name); a head tied to the embedding gets its own quantized copy and the
    embedding keeps the float table it looks rows up in."""
    head = model.lm_head
    head.set_quantized(LM_HEAD_QUANTIZERS[quantization](head.weight))


@dataclass(frozen=True)
class CheckpointFormat:
    marker: str  # the tensor suffix that marks a quantized projection
    suffixes: tuple[str, ...]  # the tensors a quantized projection has
    make: Callable[[int, int, dict, torch.device], QuantizedWeight]  # (N, K, qconfig, device)
    buffers: Callable[[dict[str, torch.Tensor], dict], dict[str, torch.Tensor]]
    skipped: tuple[str, ...] = ()  # tensors of a quantized projection that are not read


def _group_size(config: dict, in_features: int) -> int:
    group = config.get("group_size", 128)
    return in_features if group == -1 else group


def _check_bits(config: dict) -> None:
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"quantization_config.bits must be 4, got {bits!r}")


def _awq_buffers(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    q, z = awq_values(t["qweight"], t["qzeros"])
    return Int4Weight.rows(q, z, t["scales"])


def _gptq_buffers(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    k = t["qweight"].shape[0] * 8
    group = _group_size(config, k)
    in_order = torch.arange(k, device=t["g_idx"].device) // group
    if not torch.equal(t["g_idx"].long(), in_order):
        raise ValueError(
            "GPTQ g_idx must assign input channel k to group k // group_size (desc_act false); "
            "reordered groups (desc_act true) are not supported"
        )
    v1 = config.get("checkpoint_format", "gptq") == "gptq"
    q, z = gptq_values(t["qweight"], t["qzeros"], zeros_minus_one=v1)
    return Int4Weight.rows(q, z, t["scales"])


def _fp8_buffers(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    weight, scale = t["weight"], t["weight_scale"].float()
    if weight.dtype != FP8:
        raise ValueError(f"fp8 weights must be float8_e4m3fn, got {weight.dtype}")
    rows = weight.shape[0]
    if scale.numel() not in (1, rows):
        raise ValueError(
            f"weight_scale must be per tensor or per output channel, got {tuple(scale.shape)}"
        )
    return {"qweight": weight, "scales": scale.reshape(-1).expand(rows).contiguous()}


def _check_awq(config: dict) -> None:
    _check_bits(config)
    if config.get("version", "gemm").lower() != "gemm" or not config.get("zero_point", True):
        raise ValueError(
            "AWQ checkpoints must be version 'gemm' with zero_point true, got "
            f"version {config.get('version')!r}, zero_point {config.get('zero_point')!r}"
        )


def _check_gptq(config: dict) -> None:
    _check_bits(config)
    if config.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(
            "GPTQ checkpoint_format must be 'gptq' or 'gptq_v2', got "
            f"{config.get('checkpoint_format')!r}"
        )


def _check_fp8(config: dict) -> None:
    if config.get("weight_block_size") is not None:
        raise ValueError(
            "fp8 checkpoints with weight_block_size (block-wise scales) are not supported: "
            "per-tensor or per-channel weight_scale only"
        )


FORMATS = {
    "int4_awq": CheckpointFormat(
        "qweight",
        ("qweight", "qzeros", "scales"),
        lambda n, k, c, d: Int4Weight(n, k, _group_size(c, k), device=d),
        _awq_buffers,
    ),
    "int4_gptq": CheckpointFormat(
        "qweight",
        ("qweight", "qzeros", "scales", "g_idx"),
        lambda n, k, c, d: Int4Weight(n, k, _group_size(c, k), device=d),
        _gptq_buffers,
    ),
    "fp8": CheckpointFormat(
        "weight_scale",
        ("weight", "weight_scale"),
        lambda n, k, c, d: Fp8Weight(n, k, device=d),
        _fp8_buffers,
        skipped=("input_scale",),  # static activation scales: activations are scaled per token
    ),
}
_CHECKS = {"int4_awq": _check_awq, "int4_gptq": _check_gptq, "fp8": _check_fp8}


Targets = dict[str, tuple[str, tuple[int, int] | None]]


def prepare_quantized(
    model: nn.Module, quantization: str, config: dict, names: set[str], targets: Targets
) -> int:
    """On the model built on the meta device: give each Linear whose projections the checkpoint
    (tensor `names`) holds quantized an empty `QuantizedWeight` of the format. `targets`:
    `weight_targets(model)` from before. Returns how many layers are quantized."""
    _CHECKS[quantization](config)
    fmt = FORMATS[quantization]
    projections = defaultdict(list)
    for hf_name, (param_name, _) in targets.items():
        if hf_name.endswith(".weight"):
            projections[param_name.rpartition(".")[0]].append(hf_name[: -len(".weight")])
    count = 0
    for module_name, prefixes in projections.items():
        module = model.get_submodule(module_name)
        marked = [f"{p}.{fmt.marker}" in names for p in prefixes]
        if not isinstance(module, Linear) or not any(marked):
            continue
        if not all(marked):
            raise ValueError(f"{', '.join(prefixes)} must all be quantized or none of them")
        shape = (module.out_features, module.in_features)
        module.set_quantized(fmt.make(*shape, config, module.weight.device))
        count += 1
    return count


def load_quantized_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    quantization: str,
    config: dict,
    targets: Targets,
    ignored: tuple[str, ...] = (),
) -> None:
    """Fill the model (after `prepare_quantized` with the same `targets`) from the checkpoint's
    (name, tensor) pairs: each quantized projection's tensors converted into its rows of the
    layer's buffers, the rest copied. Raises ValueError on an unknown, missing or misshapen
    tensor."""
    fmt = FORMATS[quantization]
    pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    loaded = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or name in ignored:
            continue
        prefix, _, suffix = name.rpartition(".")
        weight_name = f"{prefix}.weight"
        module, rows = _target_module(model, targets, weight_name)
        if module is not None and module.quantized is not None:
            if suffix in fmt.skipped or (
                suffix == "bias" and module.bias is None and _zero(tensor)
            ):
                continue  # GPTQ writes an all-zero bias for layers without one
            if suffix in fmt.suffixes:
                pending[prefix][suffix] = tensor
                if len(pending[prefix]) == len(fmt.suffixes):
                    _fill(module.quantized, fmt.buffers(pending.pop(prefix), config), rows, prefix)
                    loaded.add(weight_name)
                continue
        if name not in targets:
            raise ValueError(f"unexpected weight {name!r} for this model")
        param_name, rows = targets[name]
        dst = model.get_parameter(param_name).data
        dst = dst if rows is None else dst.narrow(0, *rows)
        _check_shape(name, dst, tensor)
        dst.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(targets) - loaded - set(ignored))
    if missing:
        raise ValueError(f"missing weights: {', '.join(missing[:8])}")


def _target_module(model, targets, weight_name):
    if weight_name not in targets:
        return None, None
    param_name, rows = targets[weight_name]
    module = model.get_submodule(param_name.rpartition(".")[0])
    return (module, rows) if isinstance(module, Linear) else (None, None)


def _zero(tensor: torch.Tensor) -> bool:
    return not bool(tensor.any())


def _fill(quantized: QuantizedWeight, buffers: dict, rows, prefix: str) -> None:
    for buffer_name, src in buffers.items():
        dst = getattr(quantized, buffer_name)
        dst = dst if rows is None else dst.narrow(0, *rows)
        _check_shape(f"{prefix} ({buffer_name})", dst, src)
        dst.copy_(src)


def _check_shape(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )

"""Quantized weights into a model: float weights quantized at load, and quantized Hugging Face
checkpoints (which format a directory holds: backend/weight_formats.py) loaded into
`QuantizedWeight`s (each format's class, `backend.quantization.WEIGHT_CLASSES`, has its
quantizer, its checkpoint layout and its checks).

A quantized checkpoint names each quantized projection's tensors after it
(`model.layers.0.self_attn.q_proj.qweight`, `.qzeros`, `.scales`, ...), in place of `.weight`;
the lm_head, embeddings and norms are ordinary tensors. Each format's class converts one
projection's tensors into its buffers (output channels first), which then fill that
projection's rows of a fused q|k|v or gate|up layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from backend.layers.linear import Linear
from backend.quantization import WEIGHT_CLASSES, QuantizedWeight


def quantize_at_load(model: nn.Module, quantization: str, exclude: tuple[str, ...] = ()) -> int:
    """Replace the weight of every Linear except the lm_head, and those whose name holds one of
    the `exclude` fragments, by its `quantization` form (a format quantized at load); returns
    how many layers changed."""
    quantize = WEIGHT_CLASSES[quantization].quantize
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


def quantize_lm_head(model: nn.Module, quantization: str) -> None:
    """Hold the lm_head in `quantization`'s form (a format the table allows for the lm_head;
    checkpoints leave it float, so their formats round it at load: `QuantizedWeight.quantize`);
    a head tied to the embedding gets its own quantized copy and the embedding keeps the float
    table it looks rows up in."""
    head = model.lm_head
    head.set_quantized(WEIGHT_CLASSES[quantization].quantize(head.weight))


Targets = dict[str, tuple[str, tuple[int, int] | None]]


def prepare_quantized(
    model: nn.Module, quantization: str, config: dict, names: set[str], targets: Targets
) -> int:
    """On the model built on the meta device: give each Linear whose projections the checkpoint
    (tensor `names`) holds quantized an empty `QuantizedWeight` of the format. `targets`:
    `weight_targets(model)` from before. Returns how many layers are quantized."""
    weight_class = WEIGHT_CLASSES[quantization]
    weight_class.check_checkpoint(config)
    marker = weight_class.checkpoint.marker
    projections = defaultdict(list)
    for hf_name, (param_name, _) in targets.items():
        if hf_name.endswith(".weight"):
            projections[param_name.rpartition(".")[0]].append(hf_name[: -len(".weight")])
    count = 0
    for module_name, prefixes in projections.items():
        module = model.get_submodule(module_name)
        marked = [f"{p}.{marker}" in names for p in prefixes]
        if not isinstance(module, Linear) or not any(marked):
            continue
        if not all(marked):
            raise ValueError(f"{', '.join(prefixes)} must all be quantized or none of them")
        shape = (module.out_features, module.in_features)
        module.set_quantized(weight_class.for_checkpoint(*shape, config, module.weight.device))
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
    weight_class = WEIGHT_CLASSES[quantization]
    layout = weight_class.checkpoint
    pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    loaded = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or name in ignored:
            continue
        prefix, _, suffix = name.rpartition(".")
        weight_name = f"{prefix}.weight"
        module, rows = _target_module(model, targets, weight_name)
        if module is not None and module.quantized is not None:
            if suffix in layout.skipped or (
                suffix == "bias" and module.bias is None and _zero(tensor)
            ):
                continue  # GPTQ writes an all-zero bias for layers without one
            if suffix in layout.suffixes:
                pending[prefix][suffix] = tensor
                if len(pending[prefix]) == len(layout.suffixes):
                    buffers = weight_class.checkpoint_buffers(pending.pop(prefix), config)
                    _fill(module.quantized, buffers, rows, prefix)
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

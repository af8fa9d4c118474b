"""Hugging Face-named weights into a model built from `backend.layers`.

A parameter keeps its Hugging Face name, except in fused projections (`Linear.shards`: q|k|v,
gate|up), whose Hugging Face tensors each fill their rows of the fused weight. A tensor-parallel
layer (one with `shard_of`) takes its rank's part of each full tensor.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from backend.layers.linear import Linear


def load_hf_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], ignored: tuple[str, ...] = ()
) -> None:
    """Copy (Hugging Face name, tensor) pairs into `model`'s parameters, casting dtype and device.
    Names in `ignored` (and rotary inverse frequencies) are skipped. Raises ValueError on an
    unknown name, a wrong shape or a missing tensor."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    targets = weight_targets(model)
    loaded = set()
    for hf_name, tensor in weights:
        if hf_name.endswith("rotary_emb.inv_freq") or hf_name in ignored:
            continue
        if hf_name not in targets:
            raise ValueError(f"unexpected weight {hf_name!r} for this model")
        name, rows = targets[hf_name]
        module_name, _, kind = name.rpartition(".")
        shard_of = getattr(modules[module_name], "shard_of", None)
        if shard_of is not None:
            tensor = shard_of(hf_name.split(".")[-2] if rows else None, kind, tensor)
        dst = params[name].data if rows is None else params[name].data.narrow(0, *rows)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        loaded.add(hf_name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(
            f"missing weights: {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )


def weight_targets(model: nn.Module) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Hugging Face tensor name -> (our parameter name, (first row, rows) in a fused one)."""
    params = dict(model.named_parameters())  # a tied parameter appears once, first name
    targets = {}
    for module_name, module in model.named_modules():
        parent = module_name.rpartition(".")[0]
        for kind, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{kind}"
            if name not in params:
                continue
            if isinstance(module, Linear) and module.shards is not None:
                for projection, rows in module.shards.items():
                    targets[f"{parent}.{projection}.{kind}"] = (name, rows)
            else:
                targets[name] = (name, None)
    return targets

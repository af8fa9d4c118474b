"""Where each Hugging Face projection a LoRA adapter may adapt lives in a model built from
`backend.layers`: its `Linear` and its rows there (a fused q|k|v or gate|up layer holds several)."""

from __future__ import annotations

from torch import nn

from backend.layers.linear import Linear
from backend.lora.manager import LoraTarget
from backend.lora.peft_adapter import PROJECTIONS
from backend.models.hf_weights import weight_targets


def lora_targets(model: nn.Module) -> dict[str, LoraTarget]:
    """Hugging Face module name ("model.layers.0.self_attn.q_proj") -> its `LoraTarget`."""
    modules = dict(model.named_modules())
    targets = {}
    for hf_name, (name, rows) in weight_targets(model).items():
        module_name, _, kind = hf_name.rpartition(".")
        layer = modules.get(name.rpartition(".")[0])
        if kind != "weight" or module_name.rpartition(".")[2] not in PROJECTIONS:
            continue
        if not isinstance(layer, Linear):
            continue
        first, size = rows if rows is not None else (0, layer.out_features)
        targets[module_name] = LoraTarget(layer, module_name.rpartition(".")[2], first, size)
    return targets

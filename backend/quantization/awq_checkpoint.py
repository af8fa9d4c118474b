"""AWQ's scales placed in a Hugging Face checkpoint, and the writer of its AWQ checkpoints
(`int4_awq`).

In each decoder layer four groups of projections share an input, each made by something that
can take 1 / s on its outputs, so the float model computes the same:
  q|k|v    the attention's input norm
  gate|up  the norm before the MLP (post_attention_layernorm; Gemma 2/3 pre_feedforward_layernorm)
  down     up's rows (act(gate) * up is linear in each of up's outputs)
  o        v's rows (attention mixes tokens, never a value's channels); with grouped-query
           attention a channel of v feeds that channel of each query head of its group, so o's
           scales are one per v channel, repeated over those heads
An RMSNorm multiplies by w, Gemma's by (1 + w): w becomes w / s, or (1 + w) / s - 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from backend.model_config import ModelConfig
from backend.quantization.awq import ALPHAS, Scaling, quantize_scaled, search_scales
from backend.quantization.checkpoint_writer import PROJECTION, write_checkpoint
from backend.quantization.gptq import gptq_quantize
from backend.quantization.int4_packing import pack_awq
from backend.quantization.layer_inputs import LayerInputs

ROUNDINGS = ("nearest", "clip", "gptq")  # of the scaled weights (`write_awq_checkpoint`)


@dataclass
class ScaledGroup:
    """Projections (Hugging Face prefixes) sharing an input, and what makes that input."""

    projections: tuple[str, ...]
    previous: str  # a norm's or a projection's prefix
    previous_is_norm: bool


def layer_groups(tensors: dict[str, torch.Tensor], layer: int) -> list[ScaledGroup]:
    p = f"model.layers.{layer}."
    attn, mlp = p + "self_attn.", p + "mlp."
    if attn + "q_proj.weight" not in tensors or mlp + "gate_proj.weight" not in tensors:
        raise ValueError("AWQ scaling needs q, k, v, gate and up stored apart (not fused)")
    mlp_norm = "pre_feedforward_layernorm"  # Gemma 2/3: post_attention_layernorm is the block's
    if p + mlp_norm + ".weight" not in tensors:
        mlp_norm = "post_attention_layernorm"
    return [
        ScaledGroup(
            (attn + "q_proj", attn + "k_proj", attn + "v_proj"), p + "input_layernorm", True
        ),
        ScaledGroup((mlp + "gate_proj", mlp + "up_proj"), p + mlp_norm, True),
        ScaledGroup((mlp + "down_proj",), mlp + "up_proj", False),
        ScaledGroup((attn + "o_proj",), attn + "v_proj", False),
    ]


@dataclass
class Scaled:
    """A checkpoint's tensors with AWQ's scales applied (the float model unchanged)."""

    tensors: dict[str, torch.Tensor]
    input_scales: dict[str, torch.Tensor]  # by engine module name: its weight's column scales
    choices: dict[str, Scaling]  # by the group's first projection


def scale_checkpoint(
    tensors: dict[str, torch.Tensor],
    inputs: dict[str, LayerInputs],
    targets: dict,
    config: ModelConfig,
    group_size: int,
    alphas=ALPHAS,
) -> Scaled:
    """Search each group's scales on the float weights (`search_scales`), then apply them all:
    columns times s, 1 / s folded into the norm or rows before. `inputs` by engine module
    name (`backend.tools.calibration.collect_inputs`), `targets` (`weight_targets`) maps the
    Hugging Face names onto those."""
    module = {name: param.rpartition(".")[0] for name, (param, _) in targets.items()}
    tensors = dict(tensors)
    heads_per_kv = config.num_heads // config.num_kv_heads
    searched = []
    for layer in range(config.num_layers):
        for group in layer_groups(tensors, layer):
            stats = inputs[module[group.projections[0] + ".weight"]]
            mean_abs = stats.mean_abs
            if not group.previous_is_norm and group.previous.endswith("v_proj"):
                mean_abs = _tied_over_query_heads(mean_abs, heads_per_kv, config.head_dim)
            weight = torch.cat([tensors[p + ".weight"] for p in group.projections])
            searched.append(
                (group, search_scales(weight, stats.hessian, mean_abs, group_size, alphas))
            )
    input_scales, choices = {}, {}
    for group, scaling in searched:
        s = scaling.scales
        for p in group.projections:
            tensors[p + ".weight"] = tensors[p + ".weight"] * s
        input_scales[module[group.projections[0] + ".weight"]] = s
        choices[group.projections[0]] = scaling
        if group.previous_is_norm:
            w = tensors[group.previous + ".weight"]
            tensors[group.previous + ".weight"] = (
                (1 + w) / s - 1 if config.norm_unit_offset else w / s
            )
            continue
        if group.previous.endswith("v_proj"):  # one scale per v channel: the group's first head
            s = s.view(config.num_kv_heads, heads_per_kv, config.head_dim)[:, 0].reshape(-1)
        for kind in ("weight", "bias"):
            name = f"{group.previous}.{kind}"
            if name in tensors:
                shape = (-1, 1) if kind == "weight" else (-1,)
                tensors[name] = tensors[name] / s.view(shape)
    return Scaled(tensors, input_scales, choices)


def _tied_over_query_heads(mean_abs: torch.Tensor, heads_per_kv: int, head_dim: int):
    """o's mean|x| [heads * head_dim] averaged over the query heads that read one kv head."""
    per_kv = mean_abs.view(-1, heads_per_kv, head_dim).mean(dim=1, keepdim=True)
    return per_kv.expand(-1, heads_per_kv, -1).reshape(-1)


def load_tensors(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(model_dir, file)))
    return tensors


def write_awq_checkpoint(
    float_dir: str,
    out_dir: str,
    inputs: dict[str, LayerInputs],
    targets: dict,
    group_size: int,
    rounding: str = "clip",
    alphas=ALPHAS,
) -> Scaled:
    """The AWQ checkpoint of the float one: scales searched and folded (`scale_checkpoint`),
    then each decoder projection rounded in groups of `group_size` and packed in AWQ's layout.
    `rounding` (ROUNDINGS): "nearest" on each group's min..max, "clip" with each group's range
    shrunk where its outputs round better, "gptq" GPTQ's rounding of the scaled weights
    (backend/quantization/gptq.py). `alphas`: the exponents tried. Returns the scaling."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    module = {name: param.rpartition(".")[0] for name, (param, _) in targets.items()}
    config = ModelConfig.from_dir(float_dir)
    float_tensors = load_tensors(float_dir)
    scaled = scale_checkpoint(float_tensors, inputs, targets, config, group_size, alphas)
    tensors = {}
    for name, weight in scaled.tensors.items():
        if not PROJECTION.match(name):
            tensors[name] = weight
            continue
        s = scaled.input_scales[module[name]].double()
        hessian = inputs[module[name]].hessian / (s[:, None] * s[None, :])  # of x / s
        if rounding == "gptq":
            q, z, scales = gptq_quantize(weight, hessian, group_size)
        else:
            q, z, scales = quantize_scaled(
                weight, hessian if rounding == "clip" else None, group_size
            )
        qweight, qzeros = pack_awq(q, z)
        prefix = name[: -len(".weight")]
        tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros})
        tensors[f"{prefix}.scales"] = scales
    quantization = dict(
        quant_method="awq", bits=4, group_size=group_size, zero_point=True, version="gemm"
    )
    write_checkpoint(float_dir, out_dir, tensors, quantization)
    return scaled

"""A Hugging Face PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`), read
and checked against the model it is applied to.

Each adapted projection y = W x gets scaling * B (A x): A [r, in], B [out, r], scaling
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). B is stored pre-scaled, in float32, as
TensorRT-LLM's converter does; the runner casts it to the model dtype. Every error names the
adapter, the file or field and the rule it breaks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections LoRA applies to: Hugging Face names, per projection or as fused checkpoint
# tensors (Phi-3's qkv_proj and gate_up_proj).
PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
_PREFIX = "base_model.model."  # PEFT's wrapper around the model's own names


class LoraAdapterError(ValueError):
    """An adapter that cannot be served on this model."""


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [r, in_features] float32
    b: torch.Tensor  # [out_features, r] float32, pre-scaled by the adapter's scaling

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank over its modules
    # Hugging Face module name ("model.layers.3.self_attn.q_proj") -> its weights
    modules: dict[str, LoraWeights]


def load_peft_adapter(
    name: str, path: str, max_rank: int, shapes: dict[str, tuple[int, int]]
) -> LoraAdapter:
    """Read the PEFT directory `path` as adapter `name`. `shapes`: each projection of the model
    LoRA may adapt, Hugging Face module name -> (in_features, out_features)."""
    where = f"LoRA adapter {name!r} ({path})"
    config = _read_config(Path(path), where)
    r, alpha = config["r"], config["lora_alpha"]
    if r > max_rank:
        raise LoraAdapterError(f"{where}: r {r} exceeds max_lora_rank {max_rank}")
    tensors = _read_tensors(Path(path) / WEIGHTS_FILE, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, part = _split_key(key, where)
        if module.rpartition(".")[2] not in PROJECTIONS or module not in shapes:
            raise LoraAdapterError(
                f"{where}: {WEIGHTS_FILE} adapts module {module!r}, which this model has no "
                f"projection of that name for (LoRA applies to {', '.join(PROJECTIONS[:7])})"
            )
        pairs.setdefault(module, {})[part] = tensor
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraAdapterError(f"{where}: {WEIGHTS_FILE} lacks {module}'s lora_A or lora_B")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        rank = a.shape[0] if a.dim() == 2 else -1
        in_features, out_features = shapes[module]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoraAdapterError(
                f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this model needs [r, {in_features}] and [{out_features}, r]"
            )
        if rank != r and not config.get("rank_pattern"):
            raise LoraAdapterError(f"{where}: {module} has rank {rank}, adapter_config r is {r}")
        if rank > max_rank:
            raise LoraAdapterError(
                f"{where}: {module} rank {rank} exceeds max_lora_rank {max_rank}"
            )
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = LoraWeights(a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise LoraAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(name, path, max(w.rank for w in modules.values()), modules)


def _read_config(path: Path, where: str) -> dict:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoraAdapterError(f"{where}: not a directory")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoraAdapterError(f"{where}: no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraAdapterError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    _check_config(config, where)
    return config


def _check_config(config: dict, where: str) -> None:
    """The fields this engine reads, and the PEFT options it does not implement, refused."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{where}: peft_type must be LORA, got {config['peft_type']!r}")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraAdapterError(f"{where}: r must be an integer >= 1, got {r!r}")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regular expression: the tensors decide
        unknown = [t for t in targets if t.rpartition(".")[2] not in PROJECTIONS]
        if unknown:
            raise LoraAdapterError(
                f"{where}: target_modules names {', '.join(map(repr, unknown))}; LoRA applies "
                f"to {', '.join(PROJECTIONS[:7])} (or a checkpoint's fused qkv_proj, gate_up_proj)"
            )
    unsupported = {
        "use_dora": "must be false (DoRA is not supported)",
        "fan_in_fan_out": "must be false",
        "modules_to_save": "must be empty (only LoRA weights are applied)",
        "alpha_pattern": "must be empty (one lora_alpha for every module)",
    }
    for field, rule in unsupported.items():
        if config.get(field):
            raise LoraAdapterError(f"{where}: {field} {rule}, got {config[field]!r}")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"{where}: bias must be 'none', got {config['bias']!r}")


def _read_tensors(file: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise LoraAdapterError(f"{where}: no {WEIGHTS_FILE}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraAdapterError(f"{where}: {WEIGHTS_FILE} cannot be read ({exc})") from None


def _split_key(key: str, where: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' ->
    ('model.layers.0.self_attn.q_proj', 'lora_A')."""
    parts = key.removeprefix(_PREFIX).split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise LoraAdapterError(f"{where}: {WEIGHTS_FILE} holds {key!r}, not a LoRA A/B weight")
    return ".".join(parts[:-2]), parts[-2]

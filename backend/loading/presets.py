"""Random-weight models of real shapes, for benchmarking without downloading weights.

A preset resolves to a directory holding only a Hugging Face config.json and `random_weights.json`
(the seed); the loader then fills the parameters with deterministic random values directly on the
target device in the target dtype (no float32 host copy, which for 8B would be 32 GB).
There is no tokenizer: benchmarks feed token ids (or pass `tokenizer_dir` explicitly).

With `tokenizer_from` (a model directory), the preset takes that model's tokenizer files and its
vocabulary size and special ids, so it can be served through the whole Triton path (text in,
text out). The `null` preset (backend/models/null.py, a model that computes nothing) always takes
the default model's tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

RANDOM_WEIGHTS_FILE = "random_weights.json"
INIT_STD = 0.02  # keeps activations small and finite in bf16 across 32 layers

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

_GEMMA = {
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "tie_word_embeddings": True,
    "attention_bias": False,
}
PRESETS: dict[str, dict] = {
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "intermediate_size": 8192,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "intermediate_size": 14336,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    # Gemma shapes (gelu-tanh MLP, head_dim 256, local/global layers: `_default_layer_types`).
    "gemma-3-270m-random": {  # `gemma-3-270m` is the real model (named_models.py)
        **_GEMMA,
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 262144,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    },
    "gemma-2-2b": {
        **_GEMMA,
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "null": {
        "model_type": "null",
        "architectures": ["NullModel"],
        "vocab_size": 49152,
        "hidden_size": 1,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 1,
        "intermediate_size": 1,
        "max_position_embeddings": 8192,
    },
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_TOKEN_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def write_preset(
    name: str, cache_root: str, seed: int = 0, tokenizer_from: str | None = None
) -> str:
    """Write (once) the directory for preset `name` under `cache_root` and return it; with
    `tokenizer_from`, one that carries that model directory's tokenizer (see the docstring)."""
    config = dict(PRESETS[name])
    suffix = ""
    if tokenizer_from is not None:
        with open(os.path.join(tokenizer_from, "config.json")) as f:
            source = json.load(f)
        config.update({k: source[k] for k in _TOKEN_FIELDS if k in source})
        path = os.path.abspath(tokenizer_from)
        suffix = f"-vocab-{os.path.basename(path)}-{zlib.crc32(path.encode()):08x}"
    out_dir = os.path.join(cache_root, f"preset-{name}{suffix}")
    marker = os.path.join(out_dir, RANDOM_WEIGHTS_FILE)
    if os.path.isfile(marker):
        return out_dir
    os.makedirs(cache_root, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".preset-{name}.tmp-", dir=cache_root)
    os.chmod(tmp_dir, 0o755)
    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for file in TOKENIZER_FILES if tokenizer_from is not None else ():
        if os.path.isfile(os.path.join(tokenizer_from, file)):
            shutil.copy2(os.path.join(tokenizer_from, file), tmp_dir)
    with open(os.path.join(tmp_dir, RANDOM_WEIGHTS_FILE), "w") as f:
        json.dump({"preset": name, "seed": seed, "std": INIT_STD}, f)
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def random_weights_spec(model_dir: str) -> dict | None:
    """The seed and std when `model_dir` is a random-weight preset, else None."""
    path = os.path.join(model_dir, RANDOM_WEIGHTS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def init_random_weights(model: "nn.Module", seed: int = 0, std: float = INIT_STD) -> None:
    """Fill parameters in place on their device: norms 1, biases 0, matrices N(0, std)."""
    import torch  # naming a preset needs no torch

    generator = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if generator is None:
                generator = torch.Generator(param.device).manual_seed(seed)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)

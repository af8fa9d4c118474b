"""Tiny random-weight Llama-family checkpoints saved as Hugging Face directories."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama3-rope": lambda: LlamaConfig(
        **TINY,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    # SmolLM2-135M's attention shape (9 query heads on 3 kv heads, head_dim 64), two layers.
    "smollm-shape": lambda: LlamaConfig(
        **{
            **TINY,
            "hidden_size": 576,
            "intermediate_size": 256,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
        },
        tie_word_embeddings=True,
    ),
}


def make_tiny_model(kind: str, path) -> AutoModelForCausalLM:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[kind]())
    with torch.no_grad():  # random weights large enough that greedy paths differ per prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model.eval()


TINY_SHAPE = dict(
    vocab_size=640,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


def save_tiny_hf_model(path, model_type: str = "llama", seed: int = 0, **overrides):
    """Save a random-weight model of `model_type` (every parameter, biases included, random) to
    `path` with save_pretrained (safetensors) and return the transformers model in eval mode."""
    config = CONFIG_CLASSES[model_type](**{**TINY_SHAPE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model.eval()


def random_prompts(
    n: int, vocab: int, seed: int = 0, low: int = 1, high: int = 90
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]

"""Tiny random-weight checkpoints of every supported family, saved as Hugging Face directories.

Gemma 2/3 configs have sliding windows (128) longer than any prompt + output the tests serve
there, so the window does not change the result (the backends run full attention)."""

from __future__ import annotations

import random

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
FAMILY_KINDS = ("qwen3", "phi3", "gemma", "gemma2", "gemma3_text")
GEMMA_WINDOW = 128  # longer than the prompts + outputs of the tests that serve Gemma 2/3


def family_config(kind: str, shape: dict):
    """A tiny config of a family beyond Llama/Mistral/Qwen2, with what sets it apart switched on
    at values that change the result (a head size other than hidden / heads, MQA for Gemma)."""
    gemma = dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3Config(**shape, head_dim=32, tie_word_embeddings=False)
    if kind == "phi3":
        return Phi3Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "gemma":
        return GemmaConfig(**{**shape, **gemma}, hidden_act="gelu_pytorch_tanh")
    if kind == "gemma2":
        return Gemma2Config(
            **{**shape, **gemma},
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=1.5,
            sliding_window=GEMMA_WINDOW,
        )
    if kind == "gemma3_text":  # six layers: five local, one global
        return Gemma3TextConfig(
            **{"sliding_window": GEMMA_WINDOW, **shape, **gemma, "num_hidden_layers": 6},
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        )
    raise KeyError(kind)


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
    **{f"{kind}": (lambda kind=kind: family_config(kind, TINY)) for kind in FAMILY_KINDS},
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
    if model_type in FAMILY_KINDS:
        config = family_config(model_type, {**TINY_SHAPE, **overrides})
    else:
        config = CONFIG_CLASSES[model_type](**{**TINY_SHAPE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w
                param.uniform_(0.8, 1.2).sub_(1.0 if model_type.startswith("gemma") else 0.0)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model.eval()


def random_prompts(
    n: int, vocab: int, seed: int = 0, low: int = 1, high: int = 90
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]

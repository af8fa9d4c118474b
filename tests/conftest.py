"""Shared test helpers: tiny random-weight Hugging Face model directories."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

TINY_SHAPE = dict(vocab_size=640, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
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


@pytest.fixture
def tiny_hf_model(tmp_path):
    """Factory: tiny_hf_model(model_type, **config overrides) -> (transformers model, dir)."""
    def make(model_type: str = "llama", **overrides):
        path = tmp_path / f"{model_type}-{len(list(tmp_path.iterdir()))}"
        return save_tiny_hf_model(path, model_type, **overrides), path
    return make

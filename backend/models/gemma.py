"""Gemma 2 and 3: the Llama model with a norm after each block as well as before it (four per
layer). The rest (GeGLU, (1 + w) norms, scaled embeddings, soft-capping, the attention scale,
QK-norm, per-layer windows and rotary bases) are model-config options the shared layers read.
Gemma 1 is a plain `LlamaForCausalLM`. Tensor parallel, the norms are replicated (each sees the
whole hidden state: the row-parallel projections' outputs are all-reduced before them)."""

from __future__ import annotations

from torch import nn

from backend.attention import AttentionBackend
from backend.distributed.tensor_parallel import TensorParallel
from backend.layers import AttentionStep, GatedMLP, SelfAttention
from backend.model_config import ModelConfig
from backend.models.llama import LlamaForCausalLM, model_norm


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        attention: AttentionBackend,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.self_attn = SelfAttention(config, layer_index, attention, tp)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        self.input_layernorm = model_norm(config)
        self.post_attention_layernorm = model_norm(config)
        self.pre_feedforward_layernorm = model_norm(config)
        self.post_feedforward_layernorm = model_norm(config)

    def forward(self, hidden, residual, step: AttentionStep):
        """(this layer's input = hidden + residual) -> (its block output, its residual)."""
        if residual is not None:
            hidden = residual + hidden
        attended = self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), step))
        residual = hidden + attended
        out = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual)))
        return out, residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, attention=None, max_positions=None, tp=None):
        super().__init__(config, attention, max_positions, layer_class=GemmaDecoderLayer, tp=tp)

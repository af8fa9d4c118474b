"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1), built from
`backend.layers`; what sets those apart are model-config options the layers read. `LlamaModel`
also runs other decoder layers with the same (hidden, residual) protocol (backend/models/gemma.py).

All scheduled tokens of a step are packed along one axis (T tokens, no batch dimension).

Engine interface: the runner uses only these three methods, so another engine (e.g. a TensorRT
engine, where TensorRT is available) can stand in for this class:
    forward(input_ids [T], positions [T], kv_cache, attn_meta[, kv_scales]) -> hidden [T, hidden]
    compute_logits(hidden [N, hidden_size], out=None) -> float32 logits [N, vocab_size]
        (written into `out` when given: the decode CUDA graphs share one logits buffer)
    load_weights(weights: iterable of (Hugging Face tensor name, tensor))
`hidden` is the residual after the last layer: compute_logits applies the final norm, to the rows
that need logits only.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from backend.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from backend.distributed.tensor_parallel import TensorParallel
from backend.layers import (
    AttentionStep,
    Embedding,
    GatedMLP,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
)
from backend.model_config import ModelConfig
from backend.models.hf_weights import load_hf_weights


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        attention: AttentionBackend,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.self_attn = SelfAttention(config, layer_index, attention, tp)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            config.fused_checkpoint,
            tp,
        )
        self.input_layernorm = model_norm(config)
        self.post_attention_layernorm = model_norm(config)

    def forward(self, hidden, residual, step: AttentionStep):
        # where a projection's scaled GEMM quantizes its rows, the norm before it writes them so
        e4m3 = self.self_attn.takes_e4m3_rows(hidden)
        if residual is None:
            hidden, residual = self.input_layernorm(hidden, e4m3=e4m3), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, e4m3=e4m3)
        hidden = self.self_attn(hidden, step)
        e4m3 = self.mlp.takes_e4m3_rows(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual, e4m3=e4m3)
        return self.mlp(hidden), residual

    def forward_one_token(self, residual: torch.Tensor, step: AttentionStep) -> None:
        """The same layer for one token, updating the residual in place: each norm runs inside the
        projection after it, each residual add inside the projection before it."""
        self.self_attn.add_one_token(residual, self.input_layernorm, step)
        self.mlp.add_one_token(residual, self.post_attention_layernorm)


def model_norm(config: ModelConfig) -> RMSNorm:
    """An RMSNorm over the hidden size, (1 + w) where the family has it (Gemma)."""
    return RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        max_positions: int,
        layer_class: type[nn.Module] = LlamaDecoderLayer,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp)
        self.embedding_scale = config.embedding_scale
        self.layers = nn.ModuleList(
            layer_class(config, i, attention, tp) for i in range(config.num_layers)
        )
        self.norm = model_norm(config)
        self.rotary = RotaryEmbedding(
            config.rope, config.head_dim, config.max_position_embeddings, max_positions
        )
        self.local_rotary = None
        if config.local_rope is not None:
            self.local_rotary = RotaryEmbedding(
                config.local_rope, config.head_dim, config.max_position_embeddings, max_positions
            )

    def forward(self, input_ids, positions, kv_cache, meta, kv_scales=None):
        """The residual after the last layer, before the final norm (`self.norm`)."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:  # in the model's dtype, as transformers scales
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        rotation = self.rotary.rotator(positions, hidden.dtype)
        step = AttentionStep(rotation, meta, kv_cache, kv_scales=kv_scales)
        if self.local_rotary is not None:
            step.local_rotation = self.local_rotary.rotator(positions, hidden.dtype)
        if self.takes_one_token_path(hidden):
            for layer in self.layers:
                layer.forward_one_token(hidden, step)
            return hidden
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, step)
        return hidden + residual

    def takes_one_token_path(self, hidden: torch.Tensor) -> bool:
        """Whether the layers run `forward_one_token` (a one-token step on GPU, where it pays)."""
        if not self.layers or not hasattr(self.layers[0], "forward_one_token"):
            return False
        first = self.layers[0]
        return (
            not first.input_layernorm.unit_offset  # the fused norm prologues scale by w
            and first.self_attn.takes_one_token(hidden)
            and first.mlp.takes_one_token(hidden)
        )


class LlamaForCausalLM(nn.Module):
    """See the module docstring for the engine interface.

    `max_positions` sizes the RoPE cache (the longest sequence served). `tp`: this rank's place
    in a tensor-parallel group (`backend.distributed.tensor_parallel`); then the model holds its
    shard.
    """

    supports_tensor_parallel = True

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend | None = None,
        max_positions: int | None = None,
        layer_class: type[nn.Module] = LlamaDecoderLayer,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.config = config
        attention = attention or get_attention_backend("torch")
        max_positions = max_positions or config.max_position_embeddings
        self.model = LlamaModel(config, attention, max_positions, layer_class, tp)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def materialise_buffers(self, device: torch.device) -> None:
        """After building on the meta device and `to_empty`: tie the lm_head to the embedding
        again (materialising replaced the parameters) and compute the rotary cache."""
        if self.config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.model.rotary.build_cache(device)
        if self.model.local_rotary is not None:
            self.model.local_rotary.build_cache(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_meta: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`kv_scales`: a quantized cache's scales (`backend.attention.kv_dtype`), else None."""
        return self.model(input_ids, positions, kv_cache, attn_meta, kv_scales)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(hidden, self.model.norm, out=out)
        cap = self.config.final_logit_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_hf_weights(self, weights, ignored=tied)

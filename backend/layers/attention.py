"""Grouped-query self-attention with rotary embeddings over the paged KV cache.

The qkv projection, rotary and the KV-cache write, paged attention through the attention backend
(`backend.attention`), the o projection. At one token on GPU (`add_one_token`) that is three
kernels: the qkv projection with the norm before it, rotary and the KV write fused in; attention;
the o projection with the residual add fused in. Where the backend has split decode partials
and the o projection can merge them, attention leaves its splits unmerged for it.

Tensor parallel, a rank computes its query heads and the KV heads they read
(`TensorParallel.kv_heads`); the o projection is row-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backend.attention import AttentionBackend, AttentionMetadata
from backend.layers.linear import ONE_TOKEN_MAX_HIDDEN, Linear
from backend.layers.norm import RMSNorm
from backend.layers.rotary import Rotation
from backend.model_config import ModelConfig
from backend.tensor_parallel import TensorParallel


@dataclass(slots=True)
class AttentionStep:
    """One step's attention inputs, shared by every layer."""

    rotation: Rotation
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [layers, K | V, blocks, tokens_per_block, kv_heads, head_dim]


class SelfAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        tp = tp or TensorParallel()
        self.layer_index = layer_index
        d = self.head_dim = config.head_dim
        first_head, self.num_heads = tp.part(config.num_heads, "attention heads")
        first_kv, self.num_kv_heads = tp.kv_heads(config.num_heads, config.num_kv_heads)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = d**-0.5
        q_rows, kv_rows = (first_head * d, self.q_size), (first_kv * d, self.kv_size)
        self.qkv_proj = Linear.column(
            config.hidden_size,
            {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows},
            tp,
            bias=config.qkv_bias,
        )
        self.o_proj = Linear.row(config.num_heads * d, config.hidden_size, tp, bias=config.o_bias)
        self.backend = backend

    def forward(self, hidden: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        """hidden [T, hidden_size] (normed) -> [T, hidden_size]; the new keys and values are
        written to the cache before attention reads it."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = step.kv_cache[self.layer_index]
        q = step.rotation.rotate_and_write_kv(
            q, k, v, k_cache, v_cache, step.meta.slot_mapping, self.backend.write_kv
        )
        out = self.backend.paged_attention(q, k_cache, v_cache, step.meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))

    def takes_one_token(self, hidden: torch.Tensor) -> bool:
        """Whether `add_one_token` runs for hidden: a hidden size where the GEMV pays, projections
        it takes, a power-of-two head size (the fused rotary's)."""
        return (
            hidden.shape[-1] <= ONE_TOKEN_MAX_HIDDEN
            and self.head_dim & (self.head_dim - 1) == 0
            and self.qkv_proj.takes_one_token(hidden)
            and self.o_proj.takes_one_token(hidden)
        )

    def add_one_token(self, residual: torch.Tensor, norm: RMSNorm, step: AttentionStep) -> None:
        """residual [1, hidden_size] += self(norm(residual)), in place, in one-token kernels."""
        k_cache, v_cache = step.kv_cache[self.layer_index]
        qkv = self.qkv_proj.one_token_qkv(
            residual,
            norm,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            rotation=step.rotation,
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=step.meta.slot_mapping,
        )
        q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        if self.backend.decode_partials is not None and self.o_proj.merges_splits(self.head_dim):
            out = self.backend.decode_partials(q, k_cache, v_cache, step.meta, self.scale)
        else:
            out = self.backend.paged_attention(q, k_cache, v_cache, step.meta, self.scale)
            out = out.reshape(-1, self.q_size)
        self.o_proj.one_token(out, residual=residual, out=residual)

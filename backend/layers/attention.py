"""Grouped-query self-attention with rotary embeddings over the paged KV cache.

The qkv projection, rotary and the KV-cache write, paged attention through the attention backend
(`backend.attention`), the o projection. At one token on GPU (`add_one_token`) that is three
kernels: the qkv projection with the norm before it, rotary and the KV write fused in; attention;
the o projection with the residual add fused in. Where the backend has split decode partials
and the o projection can merge them, attention leaves its splits unmerged for it.

What families change is read from the model config: QK-norm (an RMSNorm over each head's q and k
before rotary: Qwen3, Gemma 3), the score scale and tanh soft-capping (Gemma 2/3), a fused
q|k|v checkpoint tensor (Phi-3), and for Gemma 3's sliding-window layers their own rotary
(`AttentionStep.local_rotation`). `sliding_window`: this layer's attention window (a query sees
the last `sliding_window` tokens, itself included), None for global attention; with it, the first
`sink_token_length` tokens stay visible too (attention sinks: the window then holds them and the
last window - sinks tokens).

Tensor parallel, a rank computes its query heads and the KV heads they read
(`TensorParallel.kv_heads`), with the same options (window, sinks, softcap, QK-norm per head);
the o projection is row-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backend.attention import AttentionBackend, AttentionMetadata
from backend.distributed.tensor_parallel import TensorParallel
from backend.layers.linear import ONE_TOKEN_MAX_HIDDEN, Linear
from backend.layers.norm import RMSNorm
from backend.layers.rotary import Rotation
from backend.model_config import ModelConfig
from backend.quantization import E4m3Rows


@dataclass(slots=True)
class AttentionStep:
    """One step's attention inputs, shared by every layer."""

    rotation: Rotation
    meta: AttentionMetadata
    # [layers, K | V, blocks, tokens_per_block, kv_heads, head_dim], or per layer when the layers
    # form several KV cache groups (each indexes its group's blocks: `meta.for_group`)
    kv_cache: torch.Tensor | tuple[torch.Tensor, ...]
    local_rotation: Rotation | None = None  # sliding-window layers' own rotary (Gemma 3)
    # A quantized cache's scales [layers, K | V, blocks, tokens_per_block, kv_heads], else None
    kv_scales: torch.Tensor | None = None

    def cache_scales(self, layer: int) -> dict:
        """The layer's K/V scales as the attention backend's keyword arguments ({}: unscaled)."""
        if self.kv_scales is None:
            return {}
        k_scales, v_scales = self.kv_scales[layer]
        return {"k_scales": k_scales, "v_scales": v_scales}


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
        self.kv_group = config.kv_cache_group_of(layer_index)  # whose block tables it reads
        d = self.head_dim = config.head_dim
        first_head, self.num_heads = tp.part(config.num_heads, "attention heads")
        first_kv, self.num_kv_heads = tp.kv_heads(config.num_heads, config.num_kv_heads)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = config.attn_scale or d**-0.5
        self.softcap = config.attn_logit_softcap
        windows = config.layer_windows
        self.sliding_window = windows[layer_index] if windows else None
        self.sink_token_length = config.sink_token_length if self.sliding_window else 0
        self.local_rope = config.local_rope is not None and self.sliding_window is not None
        q_rows, kv_rows = (first_head * d, self.q_size), (first_kv * d, self.kv_size)
        if config.fused_checkpoint:  # one q|k|v tensor: this rank's rows of each part
            q_full, kv_full = config.num_heads * d, config.num_kv_heads * d
            parts = {
                "q": q_rows,
                "k": (q_full + kv_rows[0], self.kv_size),
                "v": (q_full + kv_full + kv_rows[0], self.kv_size),
            }
        else:
            parts = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        self.qkv_proj = Linear.column(
            config.hidden_size, parts, tp, bias=config.qkv_bias, fused=config.fused_checkpoint
        )
        self.o_proj = Linear.row(config.num_heads * d, config.hidden_size, tp, bias=config.o_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, config.norm_unit_offset)
        self.backend = backend
        # options only when set: a backend without them still serves every other model
        self.attention_options = {} if self.softcap is None else {"softcap": self.softcap}
        if self.sliding_window is not None:
            self.attention_options.update(window=self.sliding_window, sinks=self.sink_token_length)

    def forward(self, hidden: torch.Tensor | E4m3Rows, step: AttentionStep) -> torch.Tensor:
        """hidden [T, hidden_size] (normed; e4m3 rows where `takes_e4m3_rows`) -> [T,
        hidden_size]; the new keys and values are written to the cache before attention reads
        it."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, k = (
                self.q_norm(q.reshape(-1, self.head_dim)),
                self.k_norm(k.reshape(-1, self.head_dim)),
            )
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = step.kv_cache[self.layer_index]
        scales = step.cache_scales(self.layer_index)
        meta = step.meta.for_group(self.kv_group)
        rotation = step.local_rotation if self.local_rope else step.rotation
        q = rotation.rotate_and_write_kv(
            q, k, v, k_cache, v_cache, meta.slot_mapping, self.backend.write_kv, **scales
        )
        out = self.backend.paged_attention(
            q, k_cache, v_cache, meta, self.scale, **self.attention_options, **scales
        )
        return self.o_proj(out.reshape(-1, self.q_size))

    def takes_e4m3_rows(self, hidden: torch.Tensor) -> bool:
        """Whether the qkv projection takes hidden's rows as e4m3 (`Linear.takes_e4m3_rows`), so
        the norm before it may write them so."""
        return self.qkv_proj.takes_e4m3_rows(hidden)

    def takes_one_token(self, hidden: torch.Tensor) -> bool:
        """Whether `add_one_token` runs for hidden: a hidden size where the GEMV pays, projections
        it takes, a power-of-two head size (the fused rotary's), none of the family options the
        fused kernels lack (QK-norm, soft-capping, a second rotary)."""
        return (
            hidden.shape[-1] <= ONE_TOKEN_MAX_HIDDEN
            and self.q_norm is None
            and self.softcap is None
            and not self.local_rope
            and self.head_dim & (self.head_dim - 1) == 0
            and self.qkv_proj.takes_one_token(hidden)
            and self.o_proj.takes_one_token(hidden)
        )

    def add_one_token(self, residual: torch.Tensor, norm: RMSNorm, step: AttentionStep) -> None:
        """residual [1, hidden_size] += self(norm(residual)), in place, in one-token kernels."""
        k_cache, v_cache = step.kv_cache[self.layer_index]
        scales = step.cache_scales(self.layer_index)
        meta = step.meta.for_group(self.kv_group)
        qkv = self.qkv_proj.one_token_qkv(
            residual,
            norm,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            rotation=step.rotation,
            k_cache=None if scales else k_cache,
            v_cache=None if scales else v_cache,
            slot_mapping=meta.slot_mapping,
        )
        partials = self.backend.decode_partials is not None and self.o_proj.merges_splits(
            self.head_dim
        )
        new_kv = None
        if scales:  # a quantized cache: its write needs whole head vectors, so it runs after
            new_kv = tuple(qkv[:, self.q_size :].view(2, -1, self.num_kv_heads, self.head_dim))
            if not partials:  # else the attention kernel writes them
                self.backend.write_kv(*new_kv, k_cache, v_cache, meta.slot_mapping, **scales)
        q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        options = {**self.attention_options, **scales}
        if partials:
            out = self.backend.decode_partials(
                q, k_cache, v_cache, meta, self.scale, new_kv=new_kv, **options
            )
        else:
            out = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale, **options)
            out = out.reshape(-1, self.q_size)
        self.o_proj.one_token(out, residual=residual, out=residual)

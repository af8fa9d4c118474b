"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) in plain PyTorch.

All scheduled tokens of a step are packed along one axis (T tokens, no batch dimension); attention
reads and writes the paged KV cache through the chosen attention backend.

Engine interface: the runner uses only these three methods, so another engine (e.g. a TensorRT
engine, where TensorRT is available) can stand in for this class:
    forward(input_ids [T], positions [T], kv_cache, attn_meta) -> hidden [T, hidden_size]
    compute_logits(hidden [N, hidden_size]) -> float32 logits [N, vocab_size]
    load_weights(weights: iterable of (Hugging Face tensor name, tensor))
`hidden` is the residual stream after the last layer: compute_logits applies the final norm, to
the rows that need logits only (at batch 1 inside the lm_head's kernel).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from backend.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from backend.model_config import ModelConfig
from backend.models.rotary import RotaryEmbedding

try:  # the fused GPU kernels; CPU-only installs without Triton use the torch path
    from backend.kernels import gemv as one_token
    from backend.kernels.qkv_rope import qkv_rope_gemv
    from backend.attention.kernels.decode import decode_attention_partials
    from backend.kernels.activation import silu_and_mul as fused_silu_and_mul
    from backend.kernels.embedding import embedding as fused_embedding
    from backend.kernels.rmsnorm import rms_norm as fused_rms_norm
except ImportError:
    fused_rms_norm = fused_silu_and_mul = fused_embedding = one_token = qkv_rope_gemv = None
    decode_attention_partials = None


# The one-token path pays where per-kernel latency dominates the weight reads. On H200 it took the
# batch-1 decode step of Llama-3.2-1B (hidden 2048) from 0.534 to 0.553 of the memory floor, and
# Llama-3.1-8B's (hidden 4096, weights 4x larger, where cuBLAS streams at ~85%) from 0.84 to 0.74.
ONE_TOKEN_MAX_HIDDEN = 2048


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does; optionally adds the
    residual first and returns the new residual (x + residual) alongside."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda and fused_rms_norm is not None:
            return fused_rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)


class FusedLinear(nn.Linear):
    """One matmul for several projections of the same input (q|k|v, gate|up).

    `shards` maps each Hugging Face projection name to its rows of the fused weight.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shards, start = {}, 0
        for name, size in shard_sizes.items():
            self.shards[name] = (start, size)
            start += size


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = FusedLinear(
            config.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.attention = attention

    def forward(self, hidden: torch.Tensor, rotation, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata):
        out = self.attend(self.qkv_proj(hidden), rotation, k_cache, v_cache, meta)
        return self.o_proj(out)

    def attend(self, qkv: torch.Tensor, rotation, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, q|k|v] -> attention output [T, q_size]; the new keys and values are written to
        the cache first."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q = rotation.rotate_and_write_kv(q, k, v, k_cache, v_cache, meta.slot_mapping,
                                         self.attention.write_kv)
        return self.attend_rotated(q, k_cache, v_cache, meta)

    def attend_rotated(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """Attention of rotated queries [T, heads, D] over the cache, which already holds the new
        keys and values -> [T, q_size]."""
        out = self.attention.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return out.reshape(-1, self.q_size)

    def qkv_one_token(self, stream: torch.Tensor, norm: "RMSNorm", rotation, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One token's rotated queries [1, heads, D] from the residual stream: RMSNorm, projection,
        rotary and the KV-cache write in one kernel (`backend.kernels.qkv_rope`)."""
        qkv = qkv_rope_gemv(stream, self.qkv_proj.weight, self.qkv_proj.bias, num_heads=self.num_heads,
                            num_kv_heads=self.num_kv_heads, cos_sin=rotation.cos_sin,
                            positions=rotation.positions, k_cache=k_cache, v_cache=v_cache,
                            slot_mapping=meta.slot_mapping, norm_weight=norm.weight, eps=norm.eps)
        return qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size},
                                        bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and fused_silu_and_mul is not None:
            return self.down_proj(fused_silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(config, attention)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, rotation, k_cache, v_cache, meta):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotation, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_one_token(self, stream, rotation, k_cache, v_cache, meta):
        """The same layer for one-token steps (GPU, bf16/fp16) in four fused weight-streaming
        GEMVs (`backend.kernels.gemv`, `backend.kernels.qkv_rope`) and attention. `stream`
        [1, hidden] is the residual stream itself, updated in place: the norms run in the qkv and
        gate_up projections' prologues, rotary and the KV write in the qkv projection's epilogue,
        the residual adds in the o and down projections' epilogues. With the Triton attention
        backend, split-K attention hands its splits to the o projection unmerged, and the o
        projection merges them as it reads them."""
        attn, mlp, linear = self.self_attn, self.mlp, one_token.gemv
        q = attn.qkv_one_token(stream, self.input_layernorm, rotation, k_cache, v_cache, meta)
        o_proj = attn.o_proj
        if attn.attention.name == "triton" and one_token.takes_partials(o_proj.weight, attn.head_dim):
            partials = decode_attention_partials(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                 meta.query_start_loc, meta.max_seq_len, attn.scale)
            linear(None, o_proj.weight, o_proj.bias, partials=partials, residual=stream, out=stream)
        else:
            out = attn.attend_rotated(q, k_cache, v_cache, meta)
            linear(out, o_proj.weight, o_proj.bias, residual=stream, out=stream)
        gate_up = linear(stream, mlp.gate_up_proj.weight, norm_weight=self.post_attention_layernorm.weight,
                         eps=self.post_attention_layernorm.eps)
        return linear(gate_up, mlp.down_proj.weight, silu_mul=True, residual=stream, out=stream)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, attention)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim,
                                      config.max_position_embeddings, max_positions)

    def forward(self, input_ids, positions, kv_cache, meta):
        """The residual stream after the last layer, before the final norm (`self.norm`), which
        `LlamaForCausalLM.compute_logits` applies."""
        if input_ids.is_cuda and fused_embedding is not None:
            hidden = fused_embedding(input_ids, self.embed_tokens.weight)
        else:
            hidden = self.embed_tokens(input_ids)
        rotation = self.rotary.rotator(positions, hidden.dtype)
        if self.takes_one_token_path(hidden):
            for i, layer in enumerate(self.layers):
                hidden = layer.forward_one_token(hidden, rotation, kv_cache[i, 0], kv_cache[i, 1], meta)
            return hidden
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, rotation, kv_cache[i, 0], kv_cache[i, 1],
                                     meta)
        return hidden + residual

    def takes_one_token_path(self, hidden: torch.Tensor) -> bool:
        """Whether this step runs `DecoderLayer.forward_one_token`: on GPU, in bf16/fp16, one
        token (a batch-1 decode step), a hidden size up to ONE_TOKEN_MAX_HIDDEN, projection widths
        the kernel tiles (multiples of 64), a power-of-two head size (the fused rotary's)."""
        head_dim = self.rotary.head_dim
        if (one_token is None or not hidden.is_cuda or not self.layers
                or hidden.shape[-1] > ONE_TOKEN_MAX_HIDDEN or head_dim & (head_dim - 1)):
            return False
        layer = self.layers[0]
        return all(one_token.supports(hidden, w) for w in (
            layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight))


class LlamaForCausalLM(nn.Module):
    """See the module docstring for the engine interface.

    `max_positions` sizes the RoPE cache (the longest sequence served). After building on the
    meta device and materialising, call `model.model.rotary.build_cache(device)`.
    """

    def __init__(self, config: ModelConfig, attention: AttentionBackend | None = None,
                 max_positions: int | None = None):
        super().__init__()
        self.config = config
        attention = attention or get_attention_backend("torch")
        self.model = LlamaModel(config, attention, max_positions or config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_cache, attn_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of `forward`'s rows: the final norm, then the lm_head."""
        weight, norm = self.lm_head.weight, self.model.norm
        if one_token is not None and hidden.is_cuda and one_token.supports(hidden, weight):
            # Batch 1: one GEMV with the norm as its prologue, ~5% faster than cuBLAS and one
            # kernel less than a separate norm.
            logits = torch.empty((1, weight.shape[0]), dtype=torch.float32, device=hidden.device)
            return one_token.gemv(hidden, weight, norm_weight=norm.weight, eps=norm.eps, out=logits)
        return self.lm_head(norm(hidden)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (partly fused) parameters, casting dtype and
        device. Raises ValueError on an unknown name, a wrong shape or a missing tensor."""
        params = dict(self.named_parameters())
        targets = self.weight_targets()
        loaded = set()
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if hf_name not in targets:
                raise ValueError(f"unexpected weight {hf_name!r} for this model")
            name, rows = targets[hf_name]
            dst = params[name].data if rows is None else params[name].data.narrow(0, *rows)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(hf_name)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"missing weights: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

    def weight_targets(self) -> dict[str, tuple[str, tuple[int, int] | None]]:
        """Hugging Face tensor name -> (our parameter name, (first row, rows) in a fused one)."""
        params = dict(self.named_parameters())        # a tied lm_head appears only as embedding
        targets = {}
        for module_name, module in self.named_modules():
            parent = module_name.rpartition(".")[0]
            for kind, _ in module.named_parameters(recurse=False):
                name = f"{module_name}.{kind}"
                if name not in params:
                    continue
                if isinstance(module, FusedLinear):
                    for proj, rows in module.shards.items():
                        targets[f"{parent}.{proj}.{kind}"] = (name, rows)
                else:
                    targets[name] = (name, None)
        return targets

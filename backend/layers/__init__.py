"""The building blocks of a model family: each owns its choice between the Triton kernels
(GPU) and torch (CPU, and the reference), and between one-token kernels and GEMMs.

- `norm.RMSNorm`: RMSNorm, with the residual add before it
- `linear.Linear`: projections (fused q|k|v and gate|up via shards); where quantized weights plug in
- `activation.silu_and_mul`: SwiGLU's activation
- `embedding.Embedding`: the token embedding lookup
- `lm_head.LMHead`: the final norm and the vocabulary projection, float32 logits
- `rotary.RotaryEmbedding`: rotary position embeddings (scaling variants) and a step's `Rotation`
- `attention.SelfAttention`: GQA self-attention over the paged KV cache, through the attention
  backend; `attention.AttentionStep`: one step's attention inputs, shared by every layer
- `mlp.GatedMLP`: SwiGLU feed-forward

`SelfAttention` and `GatedMLP` also have `add_one_token(residual, norm, ...)`: residual +=
block(norm(residual)) for one token, in fused kernels, which a pre-norm decoder layer calls for
one-token steps on GPU (see `backend.models.llama.LlamaDecoderLayer.forward_one_token`).
"""

from backend.layers.activation import silu_and_mul
from backend.layers.attention import AttentionStep, SelfAttention
from backend.layers.embedding import Embedding
from backend.layers.linear import Linear
from backend.layers.lm_head import LMHead
from backend.layers.mlp import GatedMLP
from backend.layers.norm import RMSNorm
from backend.layers.rotary import RotaryEmbedding, Rotation

__all__ = [
    "AttentionStep",
    "Embedding",
    "GatedMLP",
    "LMHead",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "Rotation",
    "SelfAttention",
    "silu_and_mul",
]

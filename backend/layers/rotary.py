"""Rotary position embeddings: inverse frequencies (with scaling variants) and a cos/sin cache.

The frequencies follow transformers' `modeling_rope_utils` so that results match it exactly:
- default: theta ** (-2i / d)
- linear:  default / factor
- llama3:  long wavelengths divided by `factor`, short ones kept, a smooth blend in between
- dynamic: NTK-aware base rescaling. transformers rescales per forward from the current length;
  we rescale once for the longest sequence we serve (`max_positions`), which is identical while
  `max_positions <= max_position_embeddings` (no rescaling at all) and a fixed-base approximation
  beyond it (the same choice vLLM makes; cached keys then stay consistent).
"""

from __future__ import annotations

import math

import torch
from torch import nn

try:  # the fused GPU kernel; CPU-only installs without Triton use the torch path
    from backend.attention.kernels.rope import apply_rotary_ as fused_rope
except ImportError:
    fused_rope = None

from backend.model_config import RopeConfig


def inverse_frequencies(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int, max_positions: int, device=None
) -> torch.Tensor:
    base = rope.theta
    if rope.type == "dynamic":
        seq_len = max(max_positions, max_position_embeddings)
        base = base * ((rope.factor * seq_len / max_position_embeddings) - (rope.factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, heads, D], k [T, kv_heads, D], cos/sin [T, 1, D] -> rotated q, k."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """A float32 cos/sin cache for `max_positions` positions, looked up once per forward.

    The looked-up rows are cast to the activations' dtype, as transformers does.
    """

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, max_positions: int
    ):
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.build_cache()

    def build_cache(self, device=None) -> None:
        """(Re)compute the cache, e.g. after the module was materialised from the meta device."""
        device = torch.device(device) if device is not None else self.cos_sin.device
        if device.type == "meta":
            self.cos_sin = torch.empty(self.max_positions, 2, self.head_dim, device=device)
            return
        inv_freq = inverse_frequencies(
            self.rope, self.head_dim, self.max_position_embeddings, self.max_positions, device
        )
        positions = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos(), emb.sin()), dim=1)  # [P, 2, head_dim] float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] -> cos, sin [T, 1, head_dim] in `dtype` (broadcast over heads)."""
        cos_sin = self.cos_sin[positions].to(dtype)
        return cos_sin[:, 0, None, :], cos_sin[:, 1, None, :]

    def rotator(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rotation":
        """This step's rotation. On GPU it is the fused in-place Triton kernel; elsewhere cos/sin
        are looked up once and applied in torch."""
        if (
            positions.is_cuda
            and fused_rope is not None
            and self.head_dim & (self.head_dim - 1) == 0
        ):
            return Rotation(positions, self.cos_sin, None, None)
        cos, sin = self(positions, dtype)
        return Rotation(positions, self.cos_sin, cos, sin)


class Rotation:
    """One step's rotary embedding, shared by every layer: `rotate_and_write_kv` rotates q and k
    and stores the new keys and values in the paged cache. With the fused kernel (no `cos`/`sin`
    looked up) that is one launch; otherwise torch rotates and the attention backend's `write_kv`
    stores. `positions` and the float32 `cos_sin` cache are there for kernels that rotate in
    their own epilogue (`backend.kernels.qkv_rope`)."""

    def __init__(self, positions, cos_sin, cos, sin):
        self.positions, self.cos_sin, self.cos, self.sin = positions, cos_sin, cos, sin

    def rotate_and_write_kv(
        self, q, k, v, k_cache, v_cache, slot_mapping, write_kv, **scales
    ) -> torch.Tensor:
        """-> rotated q; the rotated k and v are in the cache afterwards. `scales`: a quantized
        cache's (`k_scales`, `v_scales`); the fused kernel quantizes each head vector as
        `write_kv` does."""
        if self.cos is None:
            kv_write = (v, k_cache, v_cache, slot_mapping)
            kv_scales = (scales["k_scales"], scales["v_scales"]) if scales else None
            fused_rope(q, k, self.cos_sin, self.positions, kv_write, kv_scales)
            return q
        q, k = apply_rotary(q, k, self.cos, self.sin)
        write_kv(k, v, k_cache, v_cache, slot_mapping, **scales)
        return q

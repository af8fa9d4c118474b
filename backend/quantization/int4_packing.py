"""4-bit checkpoint layouts (AWQ, GPTQ) <-> plain 4-bit values, and a round-to-nearest packer.

Both formats store, per linear layer, with K input and N output features and groups of g input
channels (W^T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]):
- AWQ (AutoAWQ's "gemm" version, quant_method "awq", zero_point true)
    qweight int32 [K, N / 8]   word (k, c) holds q[k, 8c + AWQ_ORDER[p]] in bits 4p..4p+3
    qzeros  int32 [K / g, N / 8]  the zero points, packed the same way
    scales  fp16  [K / g, N]
- GPTQ (AutoGPTQ / optimum, quant_method "gptq", bits 4)
    qweight int32 [K / 8, N]   word (r, n) holds q[8r + p, n] in bits 4p
    qzeros  int32 [K / g, N / 8]  word (j, c) holds z[j, 8c + p] in bits 4p, stored as z - 1
                                  (checkpoint_format "gptq"; "gptq_v2" stores z); sym: z = 8
    scales  fp16  [K / g, N]
    g_idx   int32 [K]          each input channel's group: k // g unless desc_act reordered them
The engine keeps neither layout (`Int4Weight` is rows of bytes, output channels first); these
functions convert at load and, for tests and benchmarks, build checkpoints from float weights.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of a word holds value AWQ_ORDER[p] of its eight
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int16 [..., 8W]: nibble p of each word (low bits first) at position p."""
    shifts = _SHIFTS.to(words.device)
    values = (words[..., None] >> shifts) & 0xF
    return values.reshape(*words.shape[:-1], -1).to(torch.int16)


def pack_words(values: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_words`: [..., 8W] values in 0..15 -> int32 [..., W]."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8) & 0xF
    words = (v << _SHIFTS.to(v.device).to(torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _awq_positions(n: int) -> torch.Tensor:
    """Where each of n values sits in AWQ's unpacked word order."""
    order = torch.tensor(AWQ_ORDER)
    return (torch.arange(n).reshape(-1, 8)[:, order]).reshape(-1)


def awq_values(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's qweight, qzeros -> q [K, N], z [K / g, N] (int16, 0..15)."""
    q, z = unpack_words(qweight), unpack_words(qzeros)
    inverse = torch.argsort(_awq_positions(q.shape[1]))
    return q[:, inverse], z[:, inverse]


def gptq_values(
    qweight: torch.Tensor, qzeros: torch.Tensor, zeros_minus_one: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's qweight, qzeros -> q [K, N], z [K / g, N] (int16, 0..15)."""
    q = unpack_words(qweight.t().contiguous()).t()
    z = unpack_words(qzeros)
    return q, (z + 1) & 0xF if zeros_minus_one else z


def quantize_groups(
    weight: torch.Tensor, group_size: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of weight [N, K] in groups of `group_size` input
    channels -> q [K, N], z [K / g, N] (int16) and fp16 scales [K / g, N], in the checkpoints'
    orientation. Asymmetric: the group's min..max spans 0..15; symmetric: zero point 8."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} must be a multiple of group_size {group_size}")
    w = weight.detach().float().t().reshape(k // group_size, group_size, n)
    if symmetric:
        top = w.abs().amax(dim=1)
        scales = (2 * top / 15).clamp(min=1e-8).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int16)
    else:
        low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-8).half()
        zeros = torch.round(-low / scales.float()).clamp(0, 15).to(torch.int16)
    q = torch.round(w / scales.float()[:, None]) + zeros[:, None]
    return q.clamp(0, 15).to(torch.int16).reshape(k, n), zeros, scales


def dequantize_groups(
    q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The inverse of `quantize_groups` up to its rounding: q [K, N], z and scales [K / g, N]
    -> float32 weight [N, K]."""
    k, n = q.shape
    grouped = q.float().reshape(k // group_size, group_size, n) - z.float()[:, None]
    return (grouped * scales.float()[:, None]).reshape(k, n).t()


def pack_awq(q: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [K, N], z [K / g, N] -> AWQ's qweight, qzeros."""
    positions = _awq_positions(q.shape[1])
    return pack_words(q[:, positions]), pack_words(z[:, positions])


def pack_gptq(
    q: torch.Tensor, z: torch.Tensor, zeros_minus_one: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [K, N], z [K / g, N] -> GPTQ's qweight, qzeros."""
    stored = (z - 1) & 0xF if zeros_minus_one else z
    return pack_words(q.t().contiguous()).t().contiguous(), pack_words(stored)


def awq_tensors(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """An AWQ layer's tensors for weight [N, K] (round to nearest, no activation-aware scaling)."""
    q, z, scales = quantize_groups(weight, group_size)
    qweight, qzeros = pack_awq(q, z)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}


def gptq_tensors(
    weight: torch.Tensor, group_size: int, symmetric: bool = True
) -> dict[str, torch.Tensor]:
    """A GPTQ layer's tensors for weight [N, K] (round to nearest, no Hessian updates)."""
    q, z, scales = quantize_groups(weight, group_size, symmetric)
    qweight, qzeros = pack_gptq(q, z)
    g_idx = torch.arange(weight.shape[1], dtype=torch.int32) // group_size
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}

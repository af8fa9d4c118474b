"""GGUF quantized blocks: their layouts, and torch decoders vectorised over blocks.

A quantized row of K values is K / block_size blocks of type_size bytes each, stored as uint8.
Each decoder reproduces `gguf.quants.dequantize` (the gguf package) bit for bit: the same float32
operations in the same order (a product and a sum stay two roundings, never one fused step).

Layouts (little-endian; d, m, dmin are float16 scales):
- Q8_0: d, 32 int8 q                              value = q * d
- Q4_0: d, 16 bytes of 4-bit q (low nibbles are values 0-15, high 16-31)   (q - 8) * d
- Q4_1: d, m, 16 bytes of 4-bit q                 d * q + m
- Q5_0: d, 4 bytes of fifth bits (bit j of value j), 16 bytes of 4-bit q   (q - 16) * d
- Q4_K: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of 4-bit q; eight
  sub-blocks of 32                                (d * scale) * q - dmin * min
- Q6_K: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales, d; sixteen
  sub-blocks of 16                                (d * scale) * (q - 32)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml_type: int  # the GGML type id written in a GGUF's tensor info
    block_size: int  # values per block
    type_size: int  # bytes per block
    decode: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, type_size] -> float32 [n, block]

    def row_bytes(self, columns: int) -> int:
        if columns % self.block_size:
            raise ValueError(
                f"{self.name} rows hold whole blocks of {self.block_size} values, got {columns}"
            )
        return columns // self.block_size * self.type_size


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 scale at byte `offset` (even) of each block, widened: float32 [n, 1]."""
    return blocks.view(torch.float16)[:, offset // 2, None].float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """uint8 [n, groups * 16 bytes] -> [n, groups, 32] 4-bit values: in each group of 16 bytes
    the low nibbles come first, then the high ones."""
    n = qs.shape[0]
    halves = qs.reshape(n, groups, 1, -1) >> _shifts(4, qs.device).reshape(1, 1, 2, 1)
    return (halves & 0x0F).reshape(n, groups, -1)


def _shifts(step: int, device: torch.device) -> torch.Tensor:
    """uint8 [0, step, 2 * step, ... < 8], made on `device` (no host copy, so a CUDA graph
    can capture a decoder)."""
    return torch.arange(0, 8, step, dtype=torch.uint8, device=device)


def decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


def decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 1).reshape(blocks.shape[0], -1).to(torch.int8) - 8
    return d * q.float()


def decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:], 1).reshape(blocks.shape[0], -1).float()
    return d * q + m


def decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    high = (blocks[:, 2:6].reshape(n, 4, 1) >> _shifts(1, blocks.device)) & 1  # bit j: value j
    low = _nibbles(blocks[:, 6:], 1).reshape(n, -1)
    q = (low | (high.reshape(n, 32) << 4)).to(torch.int8) - 16
    return d * q.float()


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, [n, 8] each: bytes 0-3 hold
    scales 0-3 (low 6 bits) and the high bits of scales 4-7, bytes 4-7 the same for the mins,
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    n = scales.shape[0]
    d, m, low = scales.reshape(n, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mins = _k_scales_mins(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, -1, 1)
    offset = (dmin * mins.float()).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:], 4).reshape(n, 8, 32).float()
    return (scale * q - offset).reshape(n, QK_K)


def decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    scale = (d * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 2).reshape(n, 8, 32)  # each 64 bytes: values 0-63 low, 64-127 high
    shifts = _shifts(2, qh.device).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (scale * q.reshape(n, QK_K // 16, -1).float()).reshape(n, QK_K)


BLOCK_TYPES = {
    t.name: t
    for t in (
        BlockType("Q4_0", 2, 32, 18, decode_q4_0),
        BlockType("Q4_1", 3, 32, 20, decode_q4_1),
        BlockType("Q5_0", 6, 32, 22, decode_q5_0),
        BlockType("Q8_0", 8, 32, 34, decode_q8_0),
        BlockType("Q4_K", 12, QK_K, 144, decode_q4_k),
        BlockType("Q6_K", 14, QK_K, 210, decode_q6_k),
    )
}


def dequantize(rows: torch.Tensor, quant_type: str) -> torch.Tensor:
    """uint8 [..., row bytes] of `quant_type` blocks -> float32 [..., values per row]."""
    kind = BLOCK_TYPES[quant_type]
    if rows.dtype != torch.uint8 or rows.shape[-1] % kind.type_size:
        raise ValueError(
            f"{quant_type} rows must be uint8 of whole {kind.type_size}-byte blocks, "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )
    lead = rows.shape[:-1]
    blocks = rows.reshape(-1, kind.type_size).contiguous()  # every scale at an even byte
    values = kind.decode(blocks)
    return values.reshape(*lead, rows.shape[-1] // kind.type_size * kind.block_size)

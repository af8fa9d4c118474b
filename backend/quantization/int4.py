"""W4A16 (`int4_awq`, `int4_gptq`, `int4_wo`): 4-bit weights with a scale and a zero point per group
of `group_size` input channels, loaded from AWQ or GPTQ checkpoints (converted at load from their
packed int32 layouts, backend/quantization/int4_packing.py) or, `int4_wo`, rounded to nearest
from float weights at load; activations stay in the compute dtype.

Held as rows (output channels first, like every quantized weight):
    qweight    uint8 [N, K / 2]  byte j of row n: input channel 2j in the low nibble, 2j + 1 high
    scale_zero int32 [N, K / g]  the group's zero point (0..15) in bits 0-7 and the float16 bits
                                 of its scale in bits 16-31: one 4-byte load for both, which
                                 the kernels' load pipelines copy ahead (1- and 2-byte loads they
                                 do not)
    W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g]
A model computing in bfloat16 keeps its scales rounded to bfloat16 (`prepare_for`), so that the
GPU's 4-bit GEMM, which multiplies them into the weights in bfloat16 pairs, makes exactly the
de-quantized weights.
"""

from __future__ import annotations

import torch

from backend.kernels.gemv_weight import StreamedWeight
from backend.quantization.base import QuantizedWeight
from backend.quantization.int4_packing import quantize_groups

AT_LOAD_GROUPS = (128, 64, 32)  # int4_wo: the largest that divides a layer's input width

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels import int4_matmul
except ImportError:
    int4_matmul = None


def scale_zero_words(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """`Int4Weight.scale_zero` from float16-representable scales and zero points 0..15."""
    scale_bits = scales.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (zeros.to(torch.int32) | (scale_bits << 16)).contiguous()


def group_size_of(config: dict, in_features: int) -> int:
    """A 4-bit checkpoint's group size (`quantization_config.group_size`; -1: the whole row)."""
    group = config.get("group_size", 128)
    return in_features if group == -1 else group


def check_bits(config: dict) -> None:
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"quantization_config.bits must be 4, got {bits!r}")


class Int4Weight(QuantizedWeight):
    """`int4_wo`; the AWQ and GPTQ checkpoints' classes (backend/quantization/int4_awq.py,
    int4_gptq.py) add their layouts to it."""

    format = "int4_wo"

    def __init__(
        self,
        out_features: int,
        in_features: int,
        group_size: int,
        device: torch.device | None = None,
    ):
        super().__init__(out_features, in_features)
        if in_features % group_size or group_size % 2:
            raise ValueError(
                f"group_size must be even and divide in_features {in_features}, got {group_size}"
            )
        self.group_size = group_size
        groups = in_features // group_size
        kw = dict(device=device)
        self.register_buffer(
            "qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, **kw)
        )
        self.register_buffer(
            "scale_zero", torch.empty(out_features, groups, dtype=torch.int32, **kw)
        )

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int4Weight":
        """Round-to-nearest, asymmetric, in groups of 128 input channels (64 or 32 where 128
        does not divide the width)."""
        out_features, in_features = weight.shape
        group = next((g for g in AT_LOAD_GROUPS if in_features % g == 0), None)
        if group is None:
            raise ValueError(
                f"quantization 'int4_wo' needs in_features divisible by 32, got {in_features}"
            )
        # Rounded to nearest whatever the class: a checkpoint format's lm_head is int4_wo's.
        quantized = Int4Weight(out_features, in_features, group, device=weight.device)
        for name, tensor in Int4Weight.rows(*quantize_groups(weight, group)).items():
            getattr(quantized, name).copy_(tensor)
        return quantized

    @classmethod
    def for_checkpoint(
        cls, out_features: int, in_features: int, config: dict, device: torch.device
    ) -> Int4Weight:
        return cls(out_features, in_features, group_size_of(config, in_features), device=device)

    @staticmethod
    def rows(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
        """The buffers for values in the checkpoints' orientation: q [K, N], z and scales
        [K / g, N] -> {"qweight", "scale_zero"}, output channels first."""
        q = q.t().to(torch.uint8)
        return {
            "qweight": (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(),
            "scale_zero": scale_zero_words(scales.t(), z.t()),
        }

    @property
    def scales(self) -> torch.Tensor:
        """float16 [N, K / g]."""
        return (self.scale_zero >> 16).to(torch.int16).view(torch.float16)

    @property
    def zeros(self) -> torch.Tensor:
        """uint8 [N, K / g]."""
        return (self.scale_zero & 0xFF).to(torch.uint8)

    def prepare_for(self, dtype: torch.dtype) -> None:
        if dtype == torch.bfloat16:
            # A bfloat16 value is exact in float16 (scales lie far inside both ranges).
            rounded = self.scales.to(torch.bfloat16).to(torch.float16)
            self.scale_zero.copy_(scale_zero_words(rounded, self.zeros))

    def values(self) -> torch.Tensor:
        """The 4-bit values q [N, K] (int16)."""
        low, high = self.qweight & 0x0F, self.qweight >> 4
        return torch.stack([low, high], dim=-1).reshape(self.out_features, -1).to(torch.int16)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        g = self.group_size
        zeros = self.zeros.to(torch.int16).repeat_interleave(g, dim=1)
        scales = self.scales.float().repeat_interleave(g, dim=1)
        return ((self.values() - zeros).float() * scales).to(dtype)

    def streamed(self) -> StreamedWeight:
        return StreamedWeight(self.qweight, scale_zero=self.scale_zero, group_size=self.group_size)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda and int4_matmul is not None:
            one_row = self.streamed_matmul(x, bias)
            if one_row is not None:
                return one_row
            args = (x, self.qweight, self.scale_zero, self.group_size, bias)
            return int4_matmul.int4_gemm(*args)
        return super().matmul(x, bias)

    def matmul_float32(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if not x.is_cuda or int4_matmul is None or x.shape[0] == 1:
            return None  # one row takes the GEMV, which writes float32 through `one_token`
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        args = (x, self.qweight, self.scale_zero, self.group_size)
        return int4_matmul.int4_gemm(*args, out=out)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, " + super().extra_repr()

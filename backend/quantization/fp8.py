"""FP8 W8A8 (`fp8`): float8 e4m3 weights with one scale per output channel, activations
quantized to e4m3 per token (dynamic scales) as each product runs, products summed in float32.

The torch path below is the reference of what the Hopper kernels (`backend.kernels.fp8_gemm`)
compute: x's rows quantized, then de-quantized weights times de-quantized activations in float32.
A step of one row on GPU (batch-1 decode) leaves its activations unquantized (W8A16): it streams
the e4m3 weights through the one-token GEMV with its fusions (`backend.kernels.gemv`), where
quantizing the row would cost a pass over it before the weights stream and buy nothing, the
product being bound by reading the weights. So do steps of a few rows where the device's tuning
table says the W8A16 GEMM (`backend.kernels.w8a16_gemm`) beats quantizing the rows for the
scaled GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.kernels.gemv_weight import StreamedWeight
from backend.quantization.base import CheckpointLayout, QuantizedWeight

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels import fp8_gemm, w8a16_gemm
except ImportError:
    fp8_gemm = w8a16_gemm = None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]) with x ~= values * scales, each row's
    largest magnitude mapped to the largest e4m3 value."""
    scales = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def use_fast_accumulation(model: torch.nn.Module) -> int:
    """Let every `fp8` weight of `model` sum without promoting (`fp8_fast_accumulation`); how
    many there are."""
    weights = [m for m in model.modules() if isinstance(m, Fp8Weight)]
    for weight in weights:
        weight.fast_accumulation = True
    return len(weights)


@dataclass(frozen=True)
class E4m3Rows:
    """Activation rows already quantized as `quantize_rows` does, by the kernel that produced them
    (RMSNorm, silu·mul), for an `fp8` projection's scaled GEMM: values e4m3 [T, K], float32
    scales [T, 1], and the dtype the rows had (the product's output dtype)."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


class Fp8Weight(QuantizedWeight):
    format = "fp8"
    # Static activation scales (input_scale) are not read: activations are scaled per token.
    checkpoint = CheckpointLayout("weight_scale", ("weight", "weight_scale"), ("input_scale",))
    # torch's scaled GEMM sums without promoting (the engine's `fp8_fast_accumulation`)
    fast_accumulation = False

    def __init__(self, out_features: int, in_features: int, device: torch.device | None = None):
        super().__init__(out_features, in_features)
        shape = (out_features, in_features)
        self.register_buffer("qweight", torch.empty(shape, dtype=FP8, device=device))
        self.register_buffer("scales", torch.empty(out_features, device=device))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Fp8Weight":
        qweight, scales = quantize_rows(weight.detach())
        quantized = cls(*weight.shape, device=weight.device)
        quantized.qweight.copy_(qweight)
        quantized.scales.copy_(scales[:, 0])
        return quantized

    @classmethod
    def check_checkpoint(cls, config: dict) -> None:
        if config.get("weight_block_size") is not None:
            raise ValueError(
                "fp8 checkpoints with weight_block_size (block-wise scales) are not supported: "
                "per-tensor or per-channel weight_scale only"
            )

    @classmethod
    def for_checkpoint(
        cls, out_features: int, in_features: int, config: dict, device: torch.device
    ) -> Fp8Weight:
        return cls(out_features, in_features, device=device)

    @classmethod
    def checkpoint_buffers(
        cls, tensors: dict[str, torch.Tensor], config: dict
    ) -> dict[str, torch.Tensor]:
        weight, scale = tensors["weight"], tensors["weight_scale"].float()
        if weight.dtype != FP8:
            raise ValueError(f"fp8 weights must be float8_e4m3fn, got {weight.dtype}")
        rows = weight.shape[0]
        if scale.numel() not in (1, rows):
            raise ValueError(
                f"weight_scale must be per tensor or per output channel, got {tuple(scale.shape)}"
            )
        return {"qweight": weight, "scales": scale.reshape(-1).expand(rows).contiguous()}

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def streamed(self) -> StreamedWeight:
        return StreamedWeight(self.qweight, self.scales)

    def takes_e4m3_rows(self, x: torch.Tensor) -> bool:
        return (
            self._on_fp8_gpu(x)
            and x.shape[0] > 1
            and w8a16_gemm.tuned_config(x, self.qweight) is None
        )

    def tuned_for(self, x: torch.Tensor) -> bool:
        """Whether the device's table has a Triton FP8 GEMM config for x's rows by this weight,
        which writes any out dtype as cheaply (elsewhere a float32 out may leave torch's scaled
        GEMM, bfloat16 only, for the untuned Triton kernel)."""
        n, k = self.qweight.shape
        return fp8_gemm.tuned_config(x.shape[0], n, k, x.device) is not None

    def matmul_e4m3(
        self,
        xq: torch.Tensor,
        x_scales: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows already quantized (xq e4m3 [T, in_features], x_scales float32 [T, 1]) ->
        [T, out_features] in out_dtype (into `out` where given), through the scaled GEMM."""
        return fp8_gemm.fp8_linear(
            xq,
            x_scales,
            self.qweight,
            self.scales,
            bias,
            out_dtype=out_dtype,
            out=out,
            fast_accumulation=self.fast_accumulation,
        )

    def _on_fp8_gpu(self, x: torch.Tensor) -> bool:
        return x.is_cuda and fp8_gemm is not None and fp8_gemm.supported(x.device)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._on_fp8_gpu(x):
            one_row = self.streamed_matmul(x, bias)  # W8A16, see the module docstring
            if one_row is not None:
                return one_row
            few_rows = w8a16_gemm.tuned_config(x, self.qweight)  # swept where W8A16 is faster
            if few_rows is not None:
                return w8a16_gemm.w8a16_gemm(x, self.qweight, self.scales, bias, few_rows)
            xq, x_scales = fp8_gemm.quantize_rows(x.contiguous())
            return self.matmul_e4m3(xq, x_scales, bias, x.dtype)
        xq, x_scales = quantize_rows(x)
        out = (xq.float() @ self.qweight.float().t()) * x_scales * self.scales
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype)

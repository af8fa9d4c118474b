"""The interface every quantized weight implements (see backend/quantization/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend.kernels.gemv_weight import StreamedWeight

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels import gemv
except ImportError:
    gemv = None


@dataclass(frozen=True)
class CheckpointLayout:
    """The tensors a quantized checkpoint holds for one projection, named after it
    (`model.layers.0.self_attn.q_proj.qweight`, ...) in place of its `.weight`."""

    marker: str  # the suffix that marks a projection as quantized
    suffixes: tuple[str, ...]  # the tensors a quantized projection has
    skipped: tuple[str, ...] = ()  # tensors it may have that are not read


class QuantizedWeight(nn.Module):
    """A [out_features, in_features] weight held quantized; its tensors are buffers whose first
    dimension is out_features. A format read from checkpoints sets `checkpoint` and implements
    the three checkpoint class methods; one quantized from float weights implements
    `quantize`."""

    format: str = ""  # the `quantization` value that makes it
    checkpoint: CheckpointLayout | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> QuantizedWeight:
        """A float [out_features, in_features] weight rounded into this format (at load, and
        the lm_head that `quantize_lm_head` quantizes)."""
        raise NotImplementedError(f"{cls.format} weights are not quantized from float weights")

    @classmethod
    def check_checkpoint(cls, config: dict) -> None:
        """Raise ValueError, naming the field, unless a checkpoint's `quantization_config` is a
        variant this class reads."""

    @classmethod
    def for_checkpoint(
        cls, out_features: int, in_features: int, config: dict, device: torch.device
    ) -> QuantizedWeight:
        """An empty weight shaped as the checkpoint (`quantization_config`) stores it."""
        raise NotImplementedError(f"{cls.format} weights are not read from checkpoints")

    @classmethod
    def checkpoint_buffers(
        cls, tensors: dict[str, torch.Tensor], config: dict
    ) -> dict[str, torch.Tensor]:
        """One projection's checkpoint tensors (by suffix) -> this class's buffers, output
        channels first."""
        raise NotImplementedError(f"{cls.format} weights are not read from checkpoints")

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def prepare_for(self, dtype: torch.dtype) -> None:
        """Once loaded: adapt the buffers to a model computing in `dtype` (most formats need
        nothing)."""

    def streamed(self) -> StreamedWeight | None:
        """The weight as the one-token kernels stream it; None: a format they do not read."""
        return None

    def streamed_matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """x @ W^T (+ bias) through the one-token GEMV when it takes x (one row on GPU, a
        format it streams); None otherwise."""
        streamed = None if gemv is None or not x.is_cuda else self.streamed()
        if streamed is None or not gemv.supports(x, streamed):
            return None
        return gemv.gemv(x.contiguous(), streamed, bias)

    def takes_e4m3_rows(self, x: torch.Tensor) -> bool:
        """Whether `matmul` would quantize x's rows to e4m3 for a scaled GEMM, so a producer may
        hand them over quantized (`matmul_e4m3`)."""
        return False

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features] in x's dtype; the torch path: de-quantize into
        x's dtype, then matmul."""
        return F.linear(x, self.dequantize(x.dtype), bias)

    def matmul_float32(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """x @ W^T in float32 (into `out` where given) where the format's kernel writes float32
        itself, with no rounding to x's dtype and no cast after (the lm_head's logits); None
        where it does not."""
        return None

    def extra_repr(self) -> str:
        return f"{self.format}, out_features={self.out_features}, in_features={self.in_features}"

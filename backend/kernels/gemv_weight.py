"""A weight as the one-token kernels (`backend.kernels.gemv`, `backend.kernels.qkv_rope`) stream it:
half-precision values, int8 or e4m3 values with a float32 scale per row (`int8_wo`, `fp8`), or
packed 4-bit rows with a scale and zero point per group of inputs (`int4_*`). Torch only: the
quantized weights name theirs without importing Triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.kernels.tuning import compiles_for_gpu

DENSE, ROW_SCALED, INT4 = 0, 1, 2  # `stream_rows_dot`'s WEIGHT
ROW_SCALED_DTYPES = (torch.int8, torch.float8_e4m3fn)
# float32 bits of 2^23, passed to the 4-bit stream (`backend.kernels.gemv_int4`) as an argument
EXPONENT_2_23 = 0x4B000000
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StreamedWeight:
    values: torch.Tensor  # [N, K]; INT4: uint8 [N, K / 2], input 2j in byte j's low nibble
    scales: torch.Tensor | None = None  # ROW_SCALED: float32 [N]
    # INT4: int32 [N, K / group_size], zero point in bits 0-7, float16 scale in bits 16-31
    scale_zero: torch.Tensor | None = None
    group_size: int = 0  # INT4

    @property
    def kind(self) -> int:
        if self.scale_zero is not None:
            return INT4
        return ROW_SCALED if self.scales is not None else DENSE

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.values.shape
        return (n, 2 * k) if self.kind == INT4 else (n, k)

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def format(self) -> str | None:
        """The tuning tables' name for a stored format; None for half-precision values."""
        if self.kind == INT4:
            return f"int4g{self.group_size}"
        return None if self.kind == DENSE else str(self.values.dtype).removeprefix("torch.")

    @property
    def kernel_values(self) -> torch.Tensor:
        """What the kernels' weight pointer points at: 4-bit rows as int32 words."""
        return self.values.view(torch.int32) if self.kind == INT4 else self.values

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernels take this weight for activations like x (half precision; K in
        64-wide tiles; 4-bit groups of a multiple of 32)."""
        if x.dtype not in ACTIVATION_DTYPES or self.shape[1] % 64:
            return False
        if self.kind == DENSE:
            return self.values.dtype == x.dtype
        if self.kind == ROW_SCALED:
            return self.values.dtype in ROW_SCALED_DTYPES
        return self.group_size % 32 == 0

    def kernel_args(self) -> dict:
        """The `stream_rows_dot` arguments past the weight's values pointer."""
        args = dict(WEIGHT=self.kind)
        if self.kind == ROW_SCALED:
            args["scale_ptr"] = self.scales
        if self.kind == INT4:
            args.update(
                scale_ptr=self.scale_zero, GROUP=self.group_size, exponent_bits=EXPONENT_2_23
            )
            # inline PTX where the kernel compiles for a CUDA device (the interpreter runs none)
            args["F16X2"] = compiles_for_gpu(self.values.device)
        return args


def streamed(weight: torch.Tensor | StreamedWeight) -> StreamedWeight:
    return weight if isinstance(weight, StreamedWeight) else StreamedWeight(weight)

"""`int4_awq`: an AWQ checkpoint's 4-bit weights (AutoAWQ's "gemm" version with zero points,
quant_method "awq"), converted at load into `Int4Weight`'s rows
(backend/quantization/int4_packing.py has the packed layout)."""

from __future__ import annotations

import torch

from backend.quantization.base import CheckpointLayout
from backend.quantization.int4 import Int4Weight, check_bits
from backend.quantization.int4_packing import awq_values


class AwqWeight(Int4Weight):
    format = "int4_awq"
    checkpoint = CheckpointLayout("qweight", ("qweight", "qzeros", "scales"))

    @classmethod
    def check_checkpoint(cls, config: dict) -> None:
        check_bits(config)
        if config.get("version", "gemm").lower() != "gemm" or not config.get("zero_point", True):
            raise ValueError(
                "AWQ checkpoints must be version 'gemm' with zero_point true, got "
                f"version {config.get('version')!r}, zero_point {config.get('zero_point')!r}"
            )

    @classmethod
    def checkpoint_buffers(
        cls, tensors: dict[str, torch.Tensor], config: dict
    ) -> dict[str, torch.Tensor]:
        q, z = awq_values(tensors["qweight"], tensors["qzeros"])
        return Int4Weight.rows(q, z, tensors["scales"])

"""`int4_gptq`: a GPTQ checkpoint's 4-bit weights (AutoGPTQ / optimum, quant_method "gptq",
checkpoint_format "gptq" or "gptq_v2", groups in order), converted at load into `Int4Weight`'s
rows (backend/quantization/int4_packing.py has the packed layout)."""

from __future__ import annotations

import torch

from backend.quantization.base import CheckpointLayout
from backend.quantization.int4 import Int4Weight, check_bits, group_size_of
from backend.quantization.int4_packing import gptq_values


class GptqWeight(Int4Weight):
    format = "int4_gptq"
    checkpoint = CheckpointLayout("qweight", ("qweight", "qzeros", "scales", "g_idx"))

    @classmethod
    def check_checkpoint(cls, config: dict) -> None:
        check_bits(config)
        if config.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ValueError(
                "GPTQ checkpoint_format must be 'gptq' or 'gptq_v2', got "
                f"{config.get('checkpoint_format')!r}"
            )

    @classmethod
    def checkpoint_buffers(
        cls, tensors: dict[str, torch.Tensor], config: dict
    ) -> dict[str, torch.Tensor]:
        k = tensors["qweight"].shape[0] * 8
        group = group_size_of(config, k)
        in_order = torch.arange(k, device=tensors["g_idx"].device) // group
        if not torch.equal(tensors["g_idx"].long(), in_order):
            raise ValueError(
                "GPTQ g_idx must assign input channel k to group k // group_size (desc_act "
                "false); reordered groups (desc_act true) are not supported"
            )
        v1 = config.get("checkpoint_format", "gptq") == "gptq"  # v1 stores zero points minus one
        q, z = gptq_values(tensors["qweight"], tensors["qzeros"], zeros_minus_one=v1)
        return Int4Weight.rows(q, z, tensors["scales"])

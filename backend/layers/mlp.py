"""Gated feed-forward: down(act(gate(x)) * up(x)), with gate and up in one projection; act is
silu (SwiGLU) or tanh-approximated gelu (GeGLU). Checkpoints that store gate|up fused (Phi-3)
fill the projection as one tensor (`fused_checkpoint`).

At one token on GPU (`add_one_token`) that is two kernels: gate|up with the norm before it as
its prologue, down with silu·mul as its prologue and the residual add as its epilogue. Where an
`fp8` projection takes its rows quantized (the scaled GEMM), its producer writes them so: silu·mul
for down, the decoder layer's RMSNorm for gate|up (`takes_e4m3_rows`).

Tensor parallel, gate|up is column-parallel (a slice of the intermediate size) and down
row-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.distributed.tensor_parallel import TensorParallel
from backend.layers.activation import GATED_ACTIVATIONS, silu_and_mul_e4m3
from backend.layers.linear import ONE_TOKEN_MAX_HIDDEN, Linear
from backend.layers.norm import RMSNorm
from backend.quantization import E4m3Rows


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        fused_checkpoint: bool = False,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        tp = tp or TensorParallel()
        first, rows = tp.part(intermediate_size, "intermediate size")
        # a fused gate|up checkpoint tensor: this rank's rows of each half
        up_first = intermediate_size + first if fused_checkpoint else first
        self.gate_up_proj = Linear.column(
            hidden_size,
            {"gate_proj": (first, rows), "up_proj": (up_first, rows)},
            tp,
            fused=fused_checkpoint,
        )
        self.down_proj = Linear.row(intermediate_size, hidden_size, tp)
        self.act = act
        self.act_and_mul = GATED_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor | E4m3Rows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if (
            self.act == "silu"
            and silu_and_mul_e4m3 is not None
            and self.down_proj.takes_e4m3_rows(gate_up)
        ):  # the activation writes the rows the down projection's scaled GEMM reads
            return self.down_proj(E4m3Rows(*silu_and_mul_e4m3(gate_up), gate_up.dtype))
        return self.down_proj(self.act_and_mul(gate_up))

    def takes_e4m3_rows(self, hidden: torch.Tensor) -> bool:
        """Whether the gate|up projection takes hidden's rows as e4m3 (`Linear.takes_e4m3_rows`),
        so the norm before it may write them so."""
        return self.gate_up_proj.takes_e4m3_rows(hidden)

    def takes_one_token(self, hidden: torch.Tensor) -> bool:
        """Whether `add_one_token` runs for hidden: a hidden size where the GEMV pays, projections
        it takes."""
        return (
            hidden.shape[-1] <= ONE_TOKEN_MAX_HIDDEN
            and self.act == "silu"
            and self.gate_up_proj.takes_one_token(hidden)
            and self.down_proj.takes_one_token(hidden)
        )

    def add_one_token(self, residual: torch.Tensor, norm: RMSNorm) -> None:
        """residual [1, hidden_size] += self(norm(residual)), in place, in one-token kernels."""
        gate_up = self.gate_up_proj.one_token(residual, norm=norm)
        self.down_proj.one_token(gate_up, silu_mul=True, residual=residual, out=residual)

"""The language-model head: the final norm, then the vocabulary projection, in float32.

At one row on GPU it is one GEMV with the norm as its prologue and float32 out (one kernel
instead of a norm, a GEMM and a cast).
"""

from __future__ import annotations

import torch

from backend.layers.linear import Linear
from backend.layers.norm import RMSNorm


class LMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """hidden [N, hidden_size] (the residual after the last layer) -> logits [N, vocab_size]."""
        if self.takes_one_token(hidden) and not norm.unit_offset:
            logits = torch.empty(
                (1, self.weight.shape[0]), dtype=torch.float32, device=hidden.device
            )
            return self.one_token(hidden, norm=norm, out=logits)
        return super().forward(norm(hidden)).float()

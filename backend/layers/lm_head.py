"""The language-model head: the final norm, then the vocabulary projection, in float32.

At one row on GPU it is one GEMV with the norm as its prologue and float32 out (one kernel
instead of a norm, a GEMM and a cast). An `fp8` head of several rows, where the FP8 GEMM is tuned
for them, takes the e4m3 rows the norm writes and writes float32 logits (no row quantizer, no
cast); a 4-bit head's GEMM writes float32 logits too.

Tensor parallel, each rank projects onto its slice of the vocabulary (the embedding's slice, so
a tied head shares it) and the slices are gathered: every rank ends with the whole row.
"""

from __future__ import annotations

import torch

from backend.distributed.tensor_parallel import TensorParallel
from backend.layers.embedding import vocab_rows
from backend.layers.linear import Linear
from backend.layers.norm import RMSNorm


class LMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel | None = None):
        tp = tp or TensorParallel()
        first_id, rows = tp.vocab_part(vocab_size)
        super().__init__(hidden_size, rows, bias=False)
        self.tp, self.vocab_size, self.first_id = tp, vocab_size, first_id

    def forward(
        self, hidden: torch.Tensor, norm: RMSNorm, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [N, hidden_size] (the residual after the last layer) -> logits [N, vocab_size]
        in float32, written into `out` when given."""
        if self.tp.enabled:
            logits = self.tp.gather_columns(self._local(hidden, norm), self.vocab_size)
            return logits if out is None else out.copy_(logits)
        return self._local(hidden, norm, out)

    def shard_of(self, projection, kind: str, full: torch.Tensor) -> torch.Tensor:
        return vocab_rows(full, self.first_id, self.out_features)

    def _local(
        self, hidden: torch.Tensor, norm: RMSNorm, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.takes_one_token(hidden) and not norm.unit_offset:
            if out is None:
                out = torch.empty((1, self.out_features), dtype=torch.float32, device=hidden.device)
            return self.one_token(hidden, norm=norm, out=out)
        if (
            self.takes_e4m3_rows(hidden)
            and self.quantized.tuned_for(hidden)
            and not norm.unit_offset
        ):
            rows = norm(hidden, e4m3=True)
            return self.quantized.matmul_e4m3(rows.values, rows.scales, None, torch.float32, out)
        rows = norm(hidden)
        if self.quantized is not None:  # a 4-bit head writes float32 itself
            logits = self.quantized.matmul_float32(rows, out)
            if logits is not None:
                return logits
        logits = super().forward(rows)
        return logits.float() if out is None else out.copy_(logits)

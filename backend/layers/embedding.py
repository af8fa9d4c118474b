"""Token embedding lookup.

On CUDA the Triton kernel (`backend.kernels.embedding`), which lets the first layer's projection
start streaming its weights under programmatic dependent launch; elsewhere torch. Kept quantized
(`keep_quantized`), the looked-up rows of GGUF blocks are de-quantized.

Tensor parallel, each rank holds a slice of the vocabulary's rows (`TensorParallel.vocab_part`):
ids outside it look up zeros, and an all-reduce sums the ranks' rows (one of them non-zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.distributed.tensor_parallel import TensorParallel
from backend.gguf_blocks import BLOCK_TYPES, dequantize

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels.embedding import embedding as fused_embedding
except ImportError:
    fused_embedding = None


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp or TensorParallel()
        self.first_id, rows = self.tp.vocab_part(vocab_size)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.quant_type: str | None = None  # a GGUF block type when kept quantized
        self.dtype: torch.dtype | None = None  # what quantized rows are de-quantized into

    def keep_quantized(self, quant_type: str, dtype: torch.dtype) -> None:
        """Hold the table as `quant_type` blocks from now on (uninitialised uint8
        [vocab_size, row bytes], to be filled); rows come out in `dtype`."""
        row_bytes = BLOCK_TYPES[quant_type].row_bytes(self.hidden_size)
        qweight = torch.empty(
            self.vocab_size, row_bytes, dtype=torch.uint8, device=self.weight.device
        )
        self.weight = None
        self.register_buffer("qweight", qweight)
        self.quant_type, self.dtype = quant_type, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> rows [T, hidden_size]."""
        if self.tp.enabled:
            return self._parallel_forward(input_ids)
        if self.quant_type is not None:
            return dequantize(self.qweight[input_ids], self.quant_type).to(self.dtype)
        if input_ids.is_cuda and fused_embedding is not None:
            return fused_embedding(input_ids, self.weight)
        return F.embedding(input_ids, self.weight)

    def _parallel_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first_id
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill_(outside[:, None], 0.0))

    def shard_of(self, projection, kind: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full table, zero rows past the vocabulary's end."""
        return vocab_rows(full, self.first_id, self.weight.shape[0])


def vocab_rows(full: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """Rows [first, first + rows) of `full`, padded with zero rows past its end."""
    part = full[first : first + rows]
    if part.shape[0] == rows:
        return part
    pad = part.new_zeros((rows - part.shape[0], *part.shape[1:]))
    return torch.cat([part, pad])

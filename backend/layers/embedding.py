"""Token embedding lookup.

On CUDA the Triton kernel (`backend.kernels.embedding`), which lets the first layer's projection
start streaming its weights under programmatic dependent launch; elsewhere torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # CPU-only installs without Triton use the torch path
    from backend.kernels.embedding import embedding as fused_embedding
except ImportError:
    fused_embedding = None


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> rows [T, hidden_size]."""
        if input_ids.is_cuda and fused_embedding is not None:
            return fused_embedding(input_ids, self.weight)
        return F.embedding(input_ids, self.weight)

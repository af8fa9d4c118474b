"""A model that computes nothing: for measuring everything around the model.

The scheduler, the KV cache manager, the runner's packing, the sampler, the output processing and
the whole Triton path run as they do for a real model, while the forward pass costs next to
nothing. `python -m benchmarks.serving --model null` uses it to find the ceiling of the serving
path on a machine without a GPU.

Each row's next token depends only on its position, and is drawn from a range of ordinary
tokens (`NULL_TOKEN_RANGE`, no special ids), so outputs are deterministic, carry text and never
end early on an end id. Logits are only as wide as that range's end: the rest of the vocabulary
would never win the argmax, and full-width rows would cost a real model's lm_head in memory.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from backend.model_config import ModelConfig

NULL_TOKEN_RANGE = (1000, 3000)  # [first, end): past every tokenizer's special ids
_STRIDE = 7919  # a prime, so consecutive positions pick scattered tokens


class NullModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        first, end = NULL_TOKEN_RANGE
        if config.vocab_size < end:
            raise ValueError(
                f"the null model needs a vocabulary of at least {end} ids, got {config.vocab_size}"
            )
        self.first, self.span = first, end - first

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_meta,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The "hidden state" of a token is its position."""
        return positions

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One-hot logits [N, first + span]: the token after position p (into `out` if given)."""
        rows = hidden.shape[0]
        if out is None:
            logits = torch.zeros(
                rows, self.first + self.span, dtype=torch.float32, device=hidden.device
            )
        else:
            logits = out.zero_()
        next_ids = self.first + (hidden + 1) * _STRIDE % self.span
        logits.scatter_(1, next_ids.view(rows, 1), 1.0)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """There are none."""


def null_token(position: int) -> int:
    """The token the null model produces at `position` (what tests compare against)."""
    first, end = NULL_TOKEN_RANGE
    return first + position * _STRIDE % (end - first)

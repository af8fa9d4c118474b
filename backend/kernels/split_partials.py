"""Split-K decode attention left unmerged, for a consumer that merges the splits as it reads them.

Each split of a head's context yields its normalised output and the base-2 log-sum-exp of its
scores; `backend.kernels.split_merge.merge_splits` is the formula that merges them. A consumer
reads the tensors through their strides, so the layout is the attention kernel's to choose.
Only the first `weighed_splits` splits can carry weight (a producer that merged the rest first says
so): a consumer reads no further, which keeps its tiles of partials small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitPartials:
    outputs: torch.Tensor  # [requests, heads, splits, head_dim] float32; unset where lse is -inf
    lse: torch.Tensor  # [requests, heads, splits] float32; -inf: the split had no keys
    weighed_splits: int | None = None  # splits past it are -inf; None: any may weigh

    @property
    def num_heads(self) -> int:
        return self.outputs.shape[1]

    @property
    def num_splits(self) -> int:
        return self.outputs.shape[2]

    @property
    def splits_to_read(self) -> int:
        return self.num_splits if self.weighed_splits is None else self.weighed_splits

    @property
    def head_dim(self) -> int:
        return self.outputs.shape[3]

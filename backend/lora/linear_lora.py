"""One projection's adapter weights, in slots, and the batched product of a step.

A linear layer may fuse several Hugging Face projections (q|k|v, gate|up): each is a slice of its
output rows with its own A and B. Each slice holds A [slots, max_rank, in] and B [slots, rows,
max_rank], zero beyond an adapter's rank (fixed shapes: the layout a batched kernel and CUDA
graphs will read). The torch product: for each adapter of the step, its rows' x shrunk by A then
expanded by the pre-scaled B, added into those rows of y (rows without an adapter unchanged).
"""

from __future__ import annotations

import torch

from backend.lora.lora_batch import LoraContext
from backend.lora.peft_adapter import LoraWeights


class LinearLora:
    def __init__(
        self,
        in_features: int,
        slices: dict[str, tuple[int, int]],
        num_slots: int,
        max_rank: int,
        context: LoraContext,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """`slices`: Hugging Face projection name -> (first output row, rows) in the layer."""
        self.slices = slices
        self.context = context
        self.a = {
            name: torch.zeros(num_slots, max_rank, in_features, dtype=dtype, device=device)
            for name in slices
        }
        self.b = {
            name: torch.zeros(num_slots, rows, max_rank, dtype=dtype, device=device)
            for name, (_, rows) in slices.items()
        }
        self.ranks = {name: [0] * num_slots for name in slices}  # 0: the slot leaves it alone

    def load(self, slot: int, projection: str, weights: LoraWeights) -> None:
        r = weights.rank
        self.a[projection][slot].zero_()[:r].copy_(weights.a)
        self.b[projection][slot].zero_()[:, :r].copy_(weights.b)
        self.ranks[projection][slot] = r

    def clear(self, slot: int) -> None:
        for name in self.slices:
            self.a[name][slot].zero_()
            self.b[name][slot].zero_()
            self.ranks[name][slot] = 0

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [T, out] += each row's adapter product of x [T, in], in place; y."""
        batch = self.context.batch
        if batch is None:
            return y
        for slot, rows in batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            for name, (first, size) in self.slices.items():
                r = self.ranks[name][slot]
                if r == 0:
                    continue
                shrunk = xs @ self.a[name][slot, :r].t()
                delta = shrunk @ self.b[name][slot, :, :r].t()
                out = y.narrow(1, first, size)
                if rows is None:
                    out.add_(delta)
                else:
                    out.index_add_(0, rows, delta)
        return y

"""Which rows of a step run under which adapter: the rows grouped by adapter slot, once per step,
read by every adapted projection of the forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoraBatch:
    # (slot, the rows of the step's packed tokens under it; None: every row)
    groups: tuple[tuple[int, torch.Tensor | None], ...]

    @classmethod
    def of_tokens(cls, token_slots: np.ndarray, device: torch.device) -> LoraBatch | None:
        """token_slots [T]: each packed token's adapter slot, -1 for the base model. None when no
        token has an adapter (the step is the base model's alone)."""
        slots = np.unique(token_slots)
        slots = slots[slots >= 0]
        if slots.size == 0:
            return None
        if slots.size == 1 and (token_slots == slots[0]).all():  # no gather, no scatter
            return cls(((int(slots[0]), None),))
        # one host-to-device copy for every group's rows
        rows = [np.flatnonzero(token_slots == s) for s in slots]
        flat = torch.from_numpy(np.concatenate(rows)).to(device)
        groups, start = [], 0
        for slot, r in zip(slots, rows):
            groups.append((int(slot), flat[start : start + r.size]))
            start += r.size
        return cls(tuple(groups))


class LoraContext:
    """The running step's `LoraBatch`, shared by every adapted projection: set around a forward
    pass whose step has adapter rows, None otherwise (CUDA graphs capture and replay the base
    model only)."""

    def __init__(self):
        self.batch: LoraBatch | None = None

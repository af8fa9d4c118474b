"""A group's 4-bit grid: the scale and zero point on 0..15 of each row of a group of input
channels, over a range that holds 0: the group's min..max, or that range shrunk by the factor
that rounds the row with the least error (a few outlying weights then cost less than the
coarser steps they force on the others). GPTQ sets its grids so (backend/quantization/gptq.py),
and so does AWQ's range search (backend/quantization/awq.py).
"""

from __future__ import annotations

import torch

CLIP_FACTORS = tuple(1.0 - 0.02 * i for i in range(16))  # group ranges tried, 1.0 to 0.7


def group_grid(
    w: torch.Tensor, importance: torch.Tensor | None = None, factors=CLIP_FACTORS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) [N] of each row of w [N, g]: min..max without `importance`; with
    it, the range shrunk by the one of `factors` with the least error, weighted by importance
    [g] (H's diagonal: each weight's squared error by its input's mean square) or [g, g] (the
    group's block of H: the squared error of the outputs the group's inputs make)."""
    low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)

    def grid(factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        scale = ((high - low) * factor / 15).clamp(min=1e-8).half().float()
        return scale, torch.round(-low * factor / scale).clamp(0, 15)

    best_scale, best_zero = grid(1.0)
    if importance is None:
        return best_scale, best_zero
    best_error = torch.full((w.shape[0],), float("inf"))
    for factor in factors:
        scale, zero = grid(factor)
        delta = (rounded(w, scale, zero) - zero[:, None]) * scale[:, None] - w
        if importance.dim() == 1:
            error = (delta**2 * importance).sum(dim=1)
        else:
            error = ((delta @ importance) * delta).sum(dim=1)
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_error = torch.minimum(error, best_error)
    return best_scale, best_zero


def rounded(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The levels 0..15 of each row of w [N, g] on its grid (scale, zero [N]), as floats."""
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 15)

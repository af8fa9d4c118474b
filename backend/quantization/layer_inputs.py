"""What calibration (backend/tools/calibration.py) gathers of one projection's inputs, for the
quantizers that take it (GPTQ's H, AWQ's output error and scales)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerInputs:
    """One projection's inputs over the calibration tokens."""

    hessian: torch.Tensor  # [K, K] float64: X^T X / tokens
    mean_abs: torch.Tensor  # [K] float64: mean |x| of each input channel
    tokens: int

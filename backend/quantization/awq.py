"""AWQ (Lin et al., 2023): 4-bit weights whose input channels are scaled, before rounding, by how
large their inputs run.

Round to nearest gives every weight of a group the same step, though a weight that meets large
inputs moves the outputs more than one that meets small inputs. Multiplying input channel k of a
layer by s_k, and its input by 1 / s_k (folded into whatever makes that input, so the float
model is unchanged: backend/quantization/awq_checkpoint.py), gives the channels with large
inputs more of the group's levels. Here s = mean|x| ** alpha, alpha chosen per group of
projections sharing an input from a grid, as the one whose rounding changes their outputs on
the calibration text least. That change is measured exactly through H = X^T X of the inputs
(sum of (dW H dW^T)), so no activations are kept. After scaling, each group of input channels
may have its range shrunk where that rounds its outputs better (`int4_grid.group_grid` with the
group's block of H).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.quantization.int4_grid import group_grid, rounded
from backend.quantization.int4_packing import dequantize_groups, quantize_groups

ALPHAS = tuple(i / 19 for i in range(20))  # 0 (round to nearest) to 1 (s = mean|x|)
SMALLEST_INPUT = 1e-5  # of the largest mean|x|: a channel the text never used keeps some scale


@dataclass
class Scaling:
    """The input-channel scales chosen for a group of projections sharing an input."""

    scales: torch.Tensor  # [K] float32: the weights' columns are multiplied by them
    alpha: float
    error: float  # the group's output error, scaled and rounded to nearest
    rtn_error: float  # the same unscaled (alpha 0)


def output_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """Mean squared change of the outputs of weight [N, K] made approx over the inputs whose
    products X^T X / tokens are hessian [K, K]."""
    delta = (weight - approx).float()
    return ((delta @ hessian.float()) * delta).sum().item()


def input_scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """mean|x| ** alpha, divided by its geometric mean (only the ratios matter)."""
    base = mean_abs.float().clamp(min=mean_abs.max().item() * SMALLEST_INPUT)
    scales = base**alpha
    return scales / scales.log().mean().exp()


def search_scales(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    mean_abs: torch.Tensor,
    group_size: int,
    alphas=ALPHAS,
) -> Scaling:
    """The alpha of `alphas` whose scales, weight [N, K] (the group's projections stacked)
    rounded to nearest in groups of `group_size`, change the outputs least."""
    weight = weight.float()

    def error_of(scales: torch.Tensor) -> float:
        approx = dequantize_groups(*quantize_groups(weight * scales, group_size), group_size)
        return output_error(weight, approx / scales, hessian)

    tried = {alpha: error_of(input_scales(mean_abs, alpha)) for alpha in alphas}
    alpha = min(tried, key=tried.get)
    rtn = tried[0.0] if 0.0 in tried else error_of(torch.ones_like(weight[0]))
    return Scaling(input_scales(mean_abs, alpha), alpha, tried[alpha], rtn)


def quantize_scaled(
    weight: torch.Tensor, hessian: torch.Tensor | None, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (scaled) -> q [K, N], z [K / g, N] (int16) and fp16 scales [K / g, N], as
    `quantize_groups`, each group's range shrunk where its outputs round better over the
    inputs of `hessian` [K, K] (the scaled inputs'; None: min..max, round to nearest)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} must be a multiple of group_size {group_size}")
    w = weight.detach().float()
    levels = torch.zeros(k, n)
    scales = torch.zeros(k // group_size, n)
    zeros = torch.zeros(k // group_size, n)
    for group in range(k // group_size):
        columns = slice(group * group_size, (group + 1) * group_size)
        block = None if hessian is None else hessian[columns, columns].float()
        scales[group], zeros[group] = group_grid(w[:, columns], block)
        levels[columns] = rounded(w[:, columns], scales[group], zeros[group]).t()
    return levels.to(torch.int16), zeros.to(torch.int16), scales.half()

"""GPTQ: the rounding that moves each column's error onto the columns not yet rounded, and the
writer of its checkpoints, GPTQ (4-bit, `int4_gptq`) or FP8 (e4m3, `fp8`).

Round to nearest rounds each weight on its own. GPTQ (Frantar et al., 2022) rounds the input
columns of a layer one after another and moves each column's rounding error onto the columns
not yet rounded, weighted by the inverse of H = X^T X, the layer's input products over
calibration text: the layer's outputs on that text change as little as it can make them. The
same error moving works for any grid: only the rounding of one column differs (`gptq_quantize`,
`gptq_fp8`). Running the calibration text through the engine to get each H is
backend/tools/gptq_calibration.py's (the command line too).
"""

from __future__ import annotations

import torch

from backend.quantization.checkpoint_writer import write_quantized_copy
from backend.quantization.int4_grid import group_grid
from backend.quantization.int4_packing import pack_gptq

DAMPING = 0.01  # of the mean diagonal of H, added to it: H of a rare input is near singular
COLUMNS_PER_BLOCK = 128  # columns rounded before their error is moved onto the later ones


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    act_order: bool = True,
    clip_search: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit: weight [N, K], hessian [K, K] -> q [K, N], z [K / g, N] (int16) and fp16 scales
    [K / g, N], in the checkpoints' orientation (`int4_packing.quantize_groups`'s).

    The groups' grids are set first, from the weights as they are (`clip_search`: each range
    shrunk where that rounds the group better); `act_order` rounds the columns in order of
    falling H diagonal (the inputs that carry most first, while there are columns left to take
    their error), and the checkpoint keeps the plain group order (g_idx = k // g)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} must be a multiple of group_size {group_size}")
    w, h = _prepared(weight, hessian)
    scales = torch.zeros(k // group_size, n)
    zeros = torch.zeros(k // group_size, n)
    diagonal = torch.diagonal(h).float()
    for group in range(k // group_size):
        columns = slice(group * group_size, (group + 1) * group_size)
        importance = diagonal[columns] if clip_search else None
        scales[group], zeros[group] = group_grid(w[:, columns].float(), importance)
    col_scales = scales.repeat_interleave(group_size, 0).t().double()  # [N, K]
    col_zeros = zeros.repeat_interleave(group_size, 0).t().double()

    def round_column(col: int, column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale, zero = col_scales[:, col], col_zeros[:, col]
        levels = torch.clamp(torch.round(column / scale) + zero, 0, 15)
        return levels, (levels - zero) * scale

    levels = _compensated(w, h, round_column, act_order)
    return levels.t().to(torch.int16), zeros.to(torch.int16), scales.half()


def gptq_fp8(
    weight: torch.Tensor, hessian: torch.Tensor, act_order: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3: weight [N, K], hessian [K, K] -> (e4m3 weight [N, K], float32 scales [N]), one
    scale per output channel as `Fp8Weight.quantize` sets it, each column's rounding error moved
    onto the columns not yet rounded."""
    from backend.quantization.fp8 import FP8, FP8_MAX

    w, h = _prepared(weight, hessian)
    scales = (w.abs().amax(dim=1).float().clamp(min=1e-12) / FP8_MAX).double()

    def round_column(col: int, column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = (column / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).double()
        return values, values * scales

    values = _compensated(w, h, round_column, act_order)
    return values.to(FP8), scales.float()


def _prepared(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 copies; an input channel the calibration never used gets weight 0 and H 1."""
    w = weight.detach().double().clone()
    h = hessian.detach().double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    return w, h


def _compensated(w: torch.Tensor, h: torch.Tensor, round_column, act_order: bool) -> torch.Tensor:
    """GPTQ's loop: round w [N, K] column by column (`round_column(k, values)` -> (stored,
    de-quantized)), moving each column's error onto the columns not yet rounded through the
    inverse of H. Returns the stored values [N, K] in the original column order."""
    n, k = w.shape
    order = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, order].clone(), h[order][:, order]
    h += DAMPING * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    # The upper Cholesky factor of H^-1: row i holds how column i's error spreads to later ones.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    stored = torch.zeros(n, k, dtype=w.dtype)
    for first in range(0, k, COLUMNS_PER_BLOCK):
        last = min(first + COLUMNS_PER_BLOCK, k)
        errors = torch.zeros(n, last - first, dtype=w.dtype)
        for col in range(first, last):
            column = w[:, col]
            stored[:, col], approx = round_column(int(order[col]), column)
            error = (column - approx) / hinv[col, col]
            w[:, col:last] -= error[:, None] * hinv[col, col:last][None, :]
            errors[:, col - first] = error
        w[:, last:] -= errors @ hinv[first:last, last:]
    restored = torch.empty_like(stored)
    restored[:, order] = stored
    return restored


def write_gptq_checkpoint(
    float_dir: str,
    out_dir: str,
    hessians: dict[str, torch.Tensor],
    targets,
    group_size: int,
    weights: str = "int4",
    exclude: tuple[str, ...] = (),
) -> int:
    """A calibrated copy of the float checkpoint: each decoder projection quantized with the H
    of the layer it feeds (`targets`: `backend.models.hf_weights.weight_targets` of the model
    the hessians come from), as a GPTQ checkpoint (`weights` "int4": int4_gptq) or an FP8 one
    ("fp8": per-channel scales, dynamic activations). Layers whose module name holds one of
    the `exclude` fragments stay float (as `quantization_exclude` keeps them at load). Returns
    how many projections were quantized."""
    modules = {name: param.rpartition(".")[0] for name, (param, _) in targets.items()}
    unmatched = [f for f in exclude if not any(f in m for m in modules.values())]
    if unmatched:
        raise ValueError(f"exclude: {unmatched} match no projection of this model")
    kept = 0

    def hessian_of(name: str) -> torch.Tensor:
        return hessians[modules[name]]

    def quantized(layer_tensors):
        def tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
            nonlocal kept
            if any(fragment in modules[name] for fragment in exclude):
                kept += 1
                return {"weight": weight}
            return layer_tensors(name, weight)

        return tensors

    def int4_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, z, scales = gptq_quantize(weight, hessian_of(name), group_size)
        qweight, qzeros = pack_gptq(q, z)
        g_idx = torch.arange(weight.shape[1], dtype=torch.int32) // group_size
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}

    def fp8_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        values, scales = gptq_fp8(weight, hessian_of(name))
        return {"weight": values, "weight_scale": scales}

    if weights == "fp8":
        config = dict(quant_method="fp8", activation_scheme="dynamic")
        return write_quantized_copy(float_dir, out_dir, quantized(fp8_tensors), config) - kept
    config = dict(
        quant_method="gptq",
        bits=4,
        group_size=group_size,
        sym=False,
        desc_act=False,
        checkpoint_format="gptq",
    )
    return write_quantized_copy(float_dir, out_dir, quantized(int4_tensors), config) - kept

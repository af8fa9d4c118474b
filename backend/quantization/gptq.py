"""GPTQ: weights calibrated on text, written as a GPTQ checkpoint (4-bit, `int4_gptq`) or an
FP8 one (e4m3, `fp8`).

Round to nearest rounds each weight on its own. GPTQ (Frantar et al., 2022) rounds the input
columns of a layer one after another and moves each column's rounding error onto the columns
not yet rounded, weighted by the inverse of H = X^T X, the layer's input products over
calibration text: the layer's outputs on that text change as little as it can make them.

    python -m backend.quantization.gptq --model default --calibration TEXT_FILE --out DIR \
        [--weights int4|fp8] [--group-size 128] [--exclude layers.0.,layers.29.]

reads the float checkpoint, runs the calibration text through the engine with a hook on every
projection's input (a fused q|k|v or gate|up layer has one input, so one H for its parts), then
writes every decoder projection as GPTQ tensors (asymmetric, groups of `--group-size` input
channels, no reordering) or as e4m3 with a scale per output channel, and copies the rest. The
engine loads the result like any GPTQ or FP8 checkpoint. The same error moving works for any
grid: only the rounding of one column differs (`gptq_quantize`, `gptq_fp8`). Each layer's H is
taken from the float model (not from the layers already quantized before it, as GPTQ's reference
code does), which keeps this to one pass.
"""

from __future__ import annotations

import argparse

import torch

from backend.quantization.checkpoint_writer import write_quantized_copy
from backend.quantization.int4_packing import pack_gptq

DAMPING = 0.01  # of the mean diagonal of H, added to it: H of a rare input is near singular
COLUMNS_PER_BLOCK = 128  # columns rounded before their error is moved onto the later ones
CLIP_FACTORS = tuple(1.0 - 0.02 * i for i in range(16))  # group ranges tried, 1.0 to 0.7


def _group_grid(
    w: torch.Tensor, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of w [N, g] on 0..15, for a range that holds 0: the
    group's min..max, or with `importance` [g] (H's diagonal) that range shrunk by the factor
    of CLIP_FACTORS that rounds the row with the least importance-weighted squared error."""
    low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)

    def grid(factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        scale = ((high - low) * factor / 15).clamp(min=1e-8).half().float()
        return scale, torch.round(-low * factor / scale).clamp(0, 15)

    best_scale, best_zero = grid(1.0)
    if importance is None:
        return best_scale, best_zero
    best_error = torch.full((w.shape[0],), float("inf"))
    for factor in CLIP_FACTORS:
        scale, zero = grid(factor)
        levels = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 15)
        error = (((levels - zero[:, None]) * scale[:, None] - w) ** 2 * importance).sum(dim=1)
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_error = torch.minimum(error, best_error)
    return best_scale, best_zero


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
        scales[group], zeros[group] = _group_grid(w[:, columns].float(), importance)
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


def collect_hessians(executor, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """H = X^T X / tokens of every Linear's input (but the lm_head), by module name, over the
    prompts run through `executor` (a CPU Executor of the float model)."""
    from backend.layers.linear import Linear
    from backend.sampling_params import SamplingParams

    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def observe(name: str):
        def hook(module, inputs) -> None:
            x = inputs[0].detach().reshape(-1, module.in_features).double()
            sums[name] = sums.get(name, 0) + x.t() @ x
            counts[name] = counts.get(name, 0) + x.shape[0]

        return hook

    model = executor.runner.model
    handles = [
        module.register_forward_pre_hook(observe(name))
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "lm_head"
    ]
    try:
        executor.generate(prompts, SamplingParams(max_tokens=1))
    finally:
        for handle in handles:
            handle.remove()
    return {name: sums[name] / counts[name] for name in sums}


def calibration_prompts(tokenizer, text: str, num: int, length: int) -> list[list[int]]:
    """`num` windows of `length` tokens, evenly spread over the calibration text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < length:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than {length}")
    step = max((len(ids) - length) // max(num - 1, 1), 1)
    starts = range(0, len(ids) - length + 1, step)
    return [ids[s : s + length] for s in list(starts)[:num]]


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


def quantize_model(
    model: str,
    calibration_text: str,
    out_dir: str,
    group_size: int,
    num: int,
    length: int,
    weights: str = "int4",
    exclude: tuple[str, ...] = (),
) -> str:
    """Calibrate and write the GPTQ checkpoint of `model` (a name or directory); returns out_dir."""
    from backend.model_paths import resolve_model
    from preprocessing.tokenizer import load_tokenizer

    float_dir = resolve_model(model)
    prompts = calibration_prompts(load_tokenizer(float_dir), calibration_text, num, length)
    hessians, targets = calibrate(float_dir, prompts, max_seq_len=length + 8)
    write_gptq_checkpoint(float_dir, out_dir, hessians, targets, group_size, weights, exclude)
    return out_dir


def calibrate(float_dir: str, prompts: list[list[int]], max_seq_len: int) -> tuple[dict, dict]:
    """(H of every layer's input over `prompts`, the Hugging Face names' targets) of the float
    model in `float_dir`, run on the CPU in float32: what `write_gptq_checkpoint` takes."""
    from backend.config import EngineConfig
    from backend.executor import Executor
    from backend.models.hf_weights import weight_targets

    config = EngineConfig(
        model_path=str(float_dir), device="cpu", dtype="float32", max_seq_len=max_seq_len, seed=0
    )
    executor = Executor(config)
    try:
        return collect_hessians(executor, prompts), weight_targets(executor.runner.model)
    finally:
        executor.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default, a preset, a HF dir or a .gguf")
    p.add_argument("--calibration", required=True, help="a text file to calibrate on")
    p.add_argument("--out", required=True, help="the GPTQ checkpoint's directory")
    p.add_argument("--weights", choices=("int4", "fp8"), default="int4", help="the format")
    p.add_argument("--group-size", type=int, default=128, help="int4 groups")
    p.add_argument(
        "--exclude",
        default="",
        help="comma-separated fragments of module names kept float (e.g. 'layers.0.,layers.1.')",
    )
    p.add_argument("--num-windows", type=int, default=64, help="calibration windows")
    p.add_argument("--window", type=int, default=512, help="tokens per calibration window")
    args = p.parse_args(argv)
    with open(args.calibration) as f:
        text = f.read()
    out = quantize_model(args.model, text, args.out, args.group_size, args.num_windows, args.window)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

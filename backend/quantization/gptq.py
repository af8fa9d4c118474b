"""GPTQ: 4-bit weights calibrated on text, written as a GPTQ checkpoint (`quantization` int4_gptq).

Round to nearest rounds each weight on its own. GPTQ (Frantar et al., 2022) rounds the input
columns of a layer one after another and moves each column's rounding error onto the columns
not yet rounded, weighted by the inverse of H = X^T X, the layer's input products over
calibration text: the layer's outputs on that text change as little as it can make them.

    python -m backend.quantization.gptq --model default --calibration TEXT_FILE --out DIR

reads the float checkpoint, runs the calibration text through the engine with a hook on every
projection's input (a fused q|k|v or gate|up layer has one input, so one H for its parts), then
writes every decoder projection as GPTQ tensors (asymmetric, groups of `--group-size` input
channels, no reordering) and copies the rest. The engine loads the result like any GPTQ
checkpoint. Each layer's H is taken from the float model (not from the layers already
quantized before it, as GPTQ's reference code does), which keeps this to one pass.
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
    best_scale = best_zero = best_error = None
    for factor in CLIP_FACTORS if importance is not None else (1.0,):
        scale = ((high - low) * factor / 15).clamp(min=1e-8).half().float()
        zero = torch.round(-low * factor / scale).clamp(0, 15)
        if importance is None:
            return scale, zero
        levels = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 15)
        error = (((levels - zero[:, None]) * scale[:, None] - w) ** 2 * importance).sum(dim=1)
        if best_error is None:
            best_scale, best_zero, best_error = scale, zero, error
        else:
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
    """weight [N, K], hessian [K, K] -> q [K, N], z [K / g, N] (int16) and fp16 scales
    [K / g, N], in the checkpoints' orientation (`int4_packing.quantize_groups`'s).

    The groups' grids are set first, from the weights as they are (`clip_search`: each range
    shrunk where that rounds the group better); `act_order` then rounds the columns in order of
    falling H diagonal (the inputs that carry most first, while there are columns left to take
    their error), and the checkpoint keeps the plain group order (g_idx = k // g)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} must be a multiple of group_size {group_size}")
    w = weight.detach().double().clone()
    h = hessian.detach().double().clone()
    dead = torch.diagonal(h) == 0  # an input channel the calibration never used
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    scales = torch.zeros(k // group_size, n)
    zeros = torch.zeros(k // group_size, n)
    diagonal = torch.diagonal(h).float()
    for group in range(k // group_size):
        columns = slice(group * group_size, (group + 1) * group_size)
        importance = diagonal[columns] if clip_search else None
        scales[group], zeros[group] = _group_grid(w[:, columns].float(), importance)
    order = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, order], h[order][:, order]
    col_scales = scales[order // group_size].t().double()  # [N, K] in the rounding order
    col_zeros = zeros[order // group_size].t().double()
    h += DAMPING * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    # The upper Cholesky factor of H^-1: row i holds how column i's error spreads to later ones.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    levels = torch.zeros(n, k, dtype=w.dtype)
    for first in range(0, k, COLUMNS_PER_BLOCK):
        last = min(first + COLUMNS_PER_BLOCK, k)
        errors = torch.zeros(n, last - first, dtype=w.dtype)
        for col in range(first, last):
            scale, zero = col_scales[:, col], col_zeros[:, col]
            column = w[:, col]
            rounded = torch.clamp(torch.round(column / scale) + zero, 0, 15)
            levels[:, col] = rounded
            error = (column - (rounded - zero) * scale) / hinv[col, col]
            w[:, col:last] -= error[:, None] * hinv[col, col:last][None, :]
            errors[:, col - first] = error
        w[:, last:] -= errors @ hinv[first:last, last:]
    q = torch.empty(k, n, dtype=torch.int16)
    q[order] = levels.t().to(torch.int16)
    return q, zeros.to(torch.int16), scales.half()


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
    float_dir: str, out_dir: str, hessians: dict[str, torch.Tensor], targets, group_size: int
) -> int:
    """A GPTQ copy of the float checkpoint: each decoder projection quantized with the H of the
    layer it feeds (`targets`: `backend.models.hf_weights.weight_targets` of the model the
    hessians come from). Returns how many projections were quantized."""

    def layer_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        module = targets[name][0].rpartition(".")[0]
        q, z, scales = gptq_quantize(weight, hessians[module], group_size)
        qweight, qzeros = pack_gptq(q, z)
        g_idx = torch.arange(weight.shape[1], dtype=torch.int32) // group_size
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}

    config = dict(
        quant_method="gptq",
        bits=4,
        group_size=group_size,
        sym=False,
        desc_act=False,
        checkpoint_format="gptq",
    )
    return write_quantized_copy(float_dir, out_dir, layer_tensors, config)


def quantize_model(
    model: str, calibration_text: str, out_dir: str, group_size: int, num: int, length: int
) -> str:
    """Calibrate and write the GPTQ checkpoint of `model` (a name or directory); returns out_dir."""
    from backend.config import EngineConfig
    from backend.executor import Executor
    from backend.model_paths import resolve_model
    from backend.models.hf_weights import weight_targets
    from preprocessing.tokenizer import load_tokenizer

    float_dir = resolve_model(model)
    prompts = calibration_prompts(load_tokenizer(float_dir), calibration_text, num, length)
    executor = Executor(
        EngineConfig(
            model_path=float_dir, device="cpu", dtype="float32", max_seq_len=length + 8, seed=0
        )
    )
    try:
        hessians = collect_hessians(executor, prompts)
        targets = weight_targets(executor.runner.model)
    finally:
        executor.shutdown()
    write_gptq_checkpoint(float_dir, out_dir, hessians, targets, group_size)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default, a preset, a HF dir or a .gguf")
    p.add_argument("--calibration", required=True, help="a text file to calibrate on")
    p.add_argument("--out", required=True, help="the GPTQ checkpoint's directory")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--num-windows", type=int, default=64, help="calibration windows")
    p.add_argument("--window", type=int, default=512, help="tokens per calibration window")
    args = p.parse_args(argv)
    with open(args.calibration) as f:
        text = f.read()
    out = quantize_model(args.model, text, args.out, args.group_size, args.num_windows, args.window)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The one-token SwiGLU MLP in one kernel, its output left pending as a fixed-point sum.

At batch 1 the MLP was two weight-streaming GEMVs (`backend.kernels.gemv`): gate|up, then down
with silu·mul as its prologue. The down projection could not start its sums before the last
gate|up program had finished, and on an H100 that wait cost 45 us of a Llama-3.2-1B step
(`python -m benchmarks.gemv --chain --wait-cost`).

Here program p owns BLOCK_J intermediate features. It streams their gate and up rows over the
RMSNormed input (gemv's weight-streaming dot, the norm in its prologue), applies silu·mul, then
streams the same features' columns of the down weight and adds its partial product, [hidden]
float32 values, into the MLP's output with 64-bit fixed-point atomics (`backend.kernels.fixed_point`:
the same sum whatever order the programs land in). No program waits for another; the end of the
kernel is the only synchronisation.

The output stays pending: the next kernels that read the residual stream add round(sum) to it as
torch adds the rounded down projection, the next layer's qkv projection in its norm prologue and
its o projection in its residual epilogue, which also clears the sum (`gemv(..., pending=)`).
Rounding is otherwise the unfused path's: gate and up are rounded to the activation dtype, then
silu(gate) and the product, as `backend.kernels.activation.silu_and_mul` does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.fixed_point import to_fixed
from backend.kernels.gemv import NORM, stream_rows_dot
from backend.kernels.pdl import launch_options

_NORM = tl.constexpr(NORM)


@triton.jit
def _fused_mlp_kernel(
    x_ptr, norm_w_ptr, gate_up_ptr, down_ptr, sums_ptr, H, I, eps,
    stride_gate_up, stride_down_h, stride_down_j,
    PDL: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    PREFETCH_K: tl.constexpr, EARLY_LAUNCH: tl.constexpr, SKIP_WAIT: tl.constexpr = False,
):
    dtype = x_ptr.dtype.element_ty
    features = (tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)).to(tl.int64)
    # The program's gate and up rows interleaved: gate j0, up j0, gate j1, up j1, ...
    rows = tl.reshape(features[:, None] + I * tl.arange(0, 2)[None, :].to(tl.int64), (2 * BLOCK_J,))
    acc = stream_rows_dot(x_ptr, gate_up_ptr, norm_w_ptr, x_ptr, rows, H, stride_gate_up, eps, _NORM, PDL,
                          2 * BLOCK_J, BLOCK_K, PREFETCH_K, EARLY_LAUNCH, SKIP_WAIT)
    gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), (BLOCK_J, 2)))
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = (activated * up).to(dtype).to(tl.float32)
    down_rows = down_ptr + features[:, None] * stride_down_j
    # Programs start at different column tiles: at any moment few of them add to the same sums.
    first = (tl.program_id(0) % (H // BLOCK_H)) * BLOCK_H
    for h0 in range(0, H, BLOCK_H):
        cols = (first + h0) % H + tl.arange(0, BLOCK_H)
        w = tl.load(down_rows + cols[None, :] * stride_down_h)
        partial = tl.sum(w.to(tl.float32) * h[:, None], 0)
        tl.atomic_add(sums_ptr + cols, to_fixed(partial), sem="relaxed")


def launch_config(hidden: int, intermediate: int) -> dict:
    """Tile and launch shape: the fastest of ~50 tried in the Llama-3.2-1B chain on one H100
    (`benchmarks.gemv --chain --sweep-mlp`): 64 features a program (128 programs, one wave), one
    program of 16 warps an SM, nothing read before the wait."""
    def widest(*choices):
        return next((b for b in choices if hidden % b == 0), 64)
    return dict(BLOCK_J=64, BLOCK_K=widest(256, 128), BLOCK_H=widest(512, 256, 128), PREFETCH_K=0,
                EARLY_LAUNCH=True, num_warps=16, num_stages=3)


def supports(hidden: int, intermediate: int, config: dict | None = None) -> bool:
    """Whether the kernel tiles these sizes."""
    if hidden % 64:
        return False
    c = {**launch_config(hidden, intermediate), **(config or {})}
    return (intermediate % c["BLOCK_J"] == 0 and hidden % c["BLOCK_H"] == 0 and hidden % c["BLOCK_K"] == 0
            and c["PREFETCH_K"] % c["BLOCK_K"] == 0 and c["PREFETCH_K"] <= hidden)


def fused_mlp(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
              down_weight: torch.Tensor, sums: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """Add down(silu(gate) * up) of RMSNorm(x) to `sums`, the fixed-point [1, hidden] int64 sum.

    x [1, hidden] half precision; gate_up_weight [2 * I, hidden] (gate rows first); down_weight
    [hidden, I], either layout (a transposed view streams each program's columns contiguously).
    Returns `sums`; it must hold zeros, or what is already pending for the same stream.
    """
    hidden = x.shape[1]
    intermediate = down_weight.shape[1]
    assert x.shape[0] == 1 and x.stride(-1) == 1 and gate_up_weight.stride(-1) == 1
    assert gate_up_weight.shape == (2 * intermediate, hidden) and down_weight.shape == (hidden, intermediate)
    assert sums.shape == (1, hidden) and sums.dtype == torch.int64 and sums.is_contiguous()
    config = {**launch_config(hidden, intermediate), **(config or {})}
    assert supports(hidden, intermediate, config), (hidden, intermediate, config)
    _fused_mlp_kernel[(intermediate // config["BLOCK_J"],)](
        x, norm_weight, gate_up_weight, down_weight, sums, hidden, intermediate, eps,
        gate_up_weight.stride(0), down_weight.stride(0), down_weight.stride(1),
        **config, **launch_options(),
    )
    return sums

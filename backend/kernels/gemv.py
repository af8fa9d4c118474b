"""Linear layers for one-token steps: out = x @ weight^T with x a single row (a GEMV).

At batch 1 a decode step's projections read their weights once and do almost no arithmetic;
cuBLAS streams them well short of the copy rate, with a separate norm, activation or residual
kernel around each (benchmarks/README.md, "Kernel choices"). Here one program owns BLOCK_N output
features and walks the whole of K: every weight row is read exactly once, there is no split-K
reduction, and the products accumulate elementwise in float32 and are summed over K once, at the
end.

Fusions, each saving a kernel launch and a round trip of the activations:
- prologue "norm": the operand is RMSNorm(x) * norm_weight. The norm is folded into the one pass
  over K: the row's sum of squares accumulates beside the product with x * norm_weight, and the
  result is scaled by rsqrt(mean square + eps) at the end. (A statistics pass before the weights
  stream stalls every program; the rounding differs from RMSNorm-then-GEMM by activation-dtype
  ulps, fewer roundings rather than more.)
- prologue "silu_mul": x is [1, 2K] = gate | up and the operand is silu(gate) * up, rounded as
  `backend.kernels.activation.silu_and_mul` rounds.
- prologue "merge": the operand is split-K decode attention's output, still in its splits
  (`backend.kernels.split_partials.SplitPartials`, read through its strides): each head's
  splits are merged as the operand is read (`backend.kernels.split_merge`) and rounded to the
  activation dtype as the merged attention output would be. This is the o
  projection at batch 1: the attention kernel then needs no merge of its own.
- epilogue residual: out = round(x @ weight^T + bias) + residual, rounded once more, as torch's
  add of the two rounded tensors. `out` may be `residual` itself (each program reads and writes
  only its own columns).
Launched with programmatic dependent launch where the GPU has it (`backend.kernels.pdl`): each
program reads its first PREFETCH_K weight columns before it waits for the previous kernel (weights
are never written by a kernel), so a kernel's weights stream while its predecessor drains.
That weight-streaming dot is `backend.kernels.gemv_stream.stream_rows_dot`, shared with
`backend.kernels.qkv_rope`.

Weights may be stored quantized (`backend.kernels.gemv_weight.StreamedWeight`): int8 or e4m3
values whose float32 sums are scaled per row once, after K, or 4-bit rows
(`backend.kernels.gemv_int4`); the result is rounded to the activations' dtype (ACT_DTYPE).
4-bit rows may also split K over programs (config SPLIT, where the operand needs no norm): the
last program of a column block to arrive adds the partial sums in split order
(`backend.kernels.split_k`) and runs the epilogue.

Steps of several tokens keep the general layers: a 16-row tensor-core dot with these fusions lost
to cuBLAS (benchmarks/README.md). Launch configs are per device (`backend.kernels.gemv_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.gemv_config import checked_config
from backend.kernels.gemv_stream import stream_rows_dot
from backend.kernels.gemv_weight import ACTIVATION_DTYPES, INT4, StreamedWeight, streamed
from backend.kernels.pdl import Ordering, launch_options
from backend.kernels.split_k import add_split_partials, split_launch
from backend.kernels.split_partials import SplitPartials

NO_PROLOGUE, NORM, SILU_MUL, MERGE = 0, 1, 2, 3
ACT_DTYPES = dict(zip(ACTIVATION_DTYPES, (tl.float16, tl.bfloat16)))  # torch -> Triton
# Before its wait a program reads only weights, which no kernel writes; EARLY_LAUNCH releases then.
ORDERING = {
    early: Ordering("gemv", releases="before_wait" if early else "after_wait")
    for early in (True, False)
}


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_w_ptr,
    residual_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr,
    SKIP_WAIT: tl.constexpr = False,
    num_splits=1,
    SPLITS_PAD: tl.constexpr = 1,
    HEAD_DIM: tl.constexpr = 1,
    parts_head=0,
    parts_split=0,
    lse_head=0,
    lse_split=0,
    ACT_DTYPE: tl.constexpr = tl.float16,
    WEIGHT: tl.constexpr = 0,
    scale_ptr=0,
    GROUP: tl.constexpr = 1,
    K_LOOP: tl.constexpr = True,
    exponent_bits=0,
    F16X2: tl.constexpr = False,
    SPLIT: tl.constexpr = 1,
    k_split=0,
    part_ptr=0,
    arrivals_ptr=0,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols_in = tl.where(col_ok, cols, 0).to(tl.int64)  # masked columns read row 0
    k_start = tl.program_id(1) * k_split
    k_end = tl.minimum(k_start + k_split, K) if SPLIT > 1 else K
    acc = stream_rows_dot(
        x_ptr,
        w_ptr,
        norm_w_ptr,
        cols_in,
        K,
        stride_wn,
        eps,
        PROLOGUE,
        PDL,
        BLOCK_N,
        BLOCK_K,
        PREFETCH_K,
        EARLY_LAUNCH,
        SKIP_WAIT,
        num_splits,
        SPLITS_PAD,
        HEAD_DIM,
        parts_head,
        parts_split,
        lse_head,
        lse_split,
        ACT_DTYPE,
        WEIGHT,
        scale_ptr,
        GROUP,
        K_LOOP,
        exponent_bits,
        k_start,
        k_end,
        F16X2,
    )
    store_ok = col_ok
    if SPLIT > 1:  # the last of the column block's programs to arrive adds their sums
        last, total = add_split_partials(
            acc[:, None], part_ptr, arrivals_ptr, tl.arange(0, 1), cols, 1, N, SPLIT
        )
        acc = tl.reshape(total, [BLOCK_N])
        # `last` widened to the columns: the interpreter takes no scalar in a mask
        store_ok = col_ok & (tl.zeros([BLOCK_N], tl.int32) + last.to(tl.int32) > 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_in).to(tl.float32)
    y = acc.to(ACT_DTYPE)  # rounded as the activations are
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + cols, mask=store_ok)
        y = (y.to(tl.float32) + residual.to(tl.float32)).to(ACT_DTYPE)
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=store_ok)


def supports(x: torch.Tensor, weight: torch.Tensor | StreamedWeight) -> bool:
    """Whether `gemv` takes this product: one contiguous half-precision row, a weight it streams
    (`StreamedWeight.takes`: K in 64-wide tiles)."""
    return x.shape[0] == 1 and streamed(weight).takes(x)


def takes_partials(weight: torch.Tensor | StreamedWeight, head_dim: int) -> bool:
    """Whether `gemv(partials=...)` can merge heads of `head_dim` for this weight: its K tiles
    hold whole heads."""
    weight = streamed(weight)
    if weight.shape[1] % 64:
        return False
    config = checked_config(
        *weight.shape, None, merge=True, device=weight.device, weight_format=weight.format
    )
    return config["BLOCK_K"] % head_dim == 0 and config["PREFETCH_K"] % head_dim == 0


def gemv(
    x: torch.Tensor | None,
    weight: torch.Tensor | StreamedWeight,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
    partials: SplitPartials | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [1, K] (or [1, 2K] with `silu_mul`), weight [N, K] (or a quantized `StreamedWeight`)
    -> [1, N] in the activations' dtype `dtype` (default: x's; merged partials: the residual's,
    else a half-precision weight's).

    `norm_weight`/`eps`: RMSNorm x first. `silu_mul`: x is gate | up, use silu(gate) * up.
    `partials`: split decode attention of one request (`SplitPartials`, heads * head_dim = K):
    the operand is their merge, rounded to `dtype`; x is not read (pass None).
    `residual` [1, N]: add it to the result (`out=residual` updates it in place).
    `out` may be float32 where x is half precision: the result is rounded to x's dtype first, as
    `linear(x).float()` would be, without a second kernel.
    """
    weight = streamed(weight)
    values = weight.values
    n, k = weight.shape
    config = checked_config(
        n, k, config, merge=partials is not None, device=values.device, weight_format=weight.format
    )
    merge = {}
    if partials is not None:
        if dtype is None:
            dtype = residual.dtype if residual is not None else values.dtype
        x, lse = partials.outputs, partials.lse
        heads, head_dim = partials.num_heads, partials.head_dim
        assert x.shape[0] == 1 and heads * head_dim == k and lse.shape[:2] == (1, heads)
        splits = partials.splits_to_read
        assert x.stride(-1) == 1 and not silu_mul and norm_weight is None
        assert config["BLOCK_K"] % head_dim == 0 and config["PREFETCH_K"] % head_dim == 0
        norm_weight, prologue = lse, MERGE
        merge = dict(
            num_splits=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
            HEAD_DIM=head_dim,
            parts_head=x.stride(1),
            parts_split=x.stride(2),
            lse_head=lse.stride(1),
            lse_split=lse.stride(2),
        )
    else:
        dtype = dtype or x.dtype
        assert x.shape[0] == 1 and not (silu_mul and norm_weight is not None)
        assert x.shape[1] == (2 * k if silu_mul else k), (tuple(x.shape), weight.shape)
        assert x.stride(-1) == 1 and weight.takes(x), (x.dtype, values.dtype, weight.format)
        prologue = SILU_MUL if silu_mul else NORM if norm_weight is not None else NO_PROLOGUE
    assert values.stride(-1) == 1 and (weight.kind != INT4 or values.is_contiguous())
    assert weight.kind != INT4 or config["BLOCK_K"] % weight.group_size == 0, "whole groups a tile"
    if out is None:
        out = torch.empty((1, n), dtype=dtype, device=values.device)
    assert residual is None or residual.is_contiguous() and out.is_contiguous()
    # 4-bit rows may split K over programs where the operand needs no sum over all of K (norm).
    split = config.get("SPLIT", 1) if weight.kind == INT4 and prologue != NORM else 1
    launch = split_launch("gemv", k, split, config["BLOCK_K"], n, config["BLOCK_N"], values.device)
    part_sums, arrivals = launch.buffers(out)
    _gemv_kernel[launch.grid](
        x,
        weight.kernel_values,
        bias if bias is not None else values,
        norm_weight if norm_weight is not None else values,
        residual if residual is not None else out,
        out,
        n,
        k,
        values.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        ACT_DTYPE=ACT_DTYPES[dtype],
        K_LOOP=config["PREFETCH_K"] < k,
        **weight.kernel_args(),
        **merge,
        **{**config, "SPLIT": launch.split},
        k_split=launch.per_split,
        part_ptr=part_sums,
        arrivals_ptr=arrivals,
        **launch_options(ORDERING[config["EARLY_LAUNCH"]]),
    )
    return out

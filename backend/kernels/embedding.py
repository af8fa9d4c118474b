"""Token embedding lookup: out[t] = weight[ids[t]], launched with PDL.

torch's embedding does the same work, but as a plain launch it lets nothing start before it ends.
This kernel lets the next one launch as soon as it has waited for its own predecessor
(`backend.kernels.pdl`), so in a batch-1 decode step the first layer's projection starts streaming
its weights while the rows are gathered. Not earlier: the kernels after it read step inputs before
they wait, and in a decode CUDA graph those were written by the kernel before this one
(`backend.kernels.step_inputs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.pdl import Ordering, gdc_launch_dependents, gdc_wait, launch_options

BLOCK = 1024
ORDERING = Ordering("embedding", releases="after_wait")


@triton.jit
def _embedding_kernel(
    ids_ptr,
    weight_ptr,
    out_ptr,
    vocab,
    hidden,
    stride_w,
    stride_out,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(ids_ptr + token).to(tl.int64)
    known = (row >= 0) & (row < vocab)
    inside = cols < hidden
    values = tl.load(weight_ptr + tl.where(known, row, 0) * stride_w + cols, mask=inside, other=0.0)
    tl.store(out_ptr + token * stride_out + cols, tl.where(known, values, 0.0), mask=inside)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [T] (int) -> weight[ids] [T, hidden]. An id outside [0, vocab) gives a row of zeros
    (the engine validates ids on the host; torch's embedding would stop the process with a
    device-side assertion)."""
    assert ids.dim() == 1 and weight.dim() == 2 and weight.stride(1) == 1
    out = torch.empty(ids.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device)
    if ids.numel():
        _embedding_kernel[(ids.numel(), triton.cdiv(weight.shape[1], BLOCK))](
            ids,
            weight,
            out,
            weight.shape[0],
            weight.shape[1],
            weight.stride(0),
            out.stride(0),
            BLOCK=BLOCK,
            num_warps=4,
            **launch_options(ORDERING),
        )
    return out

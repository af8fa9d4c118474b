"""Placeholder input ids of a decode CUDA graph step, filled on the device.

With overlap scheduling a request's next input id is the token the previous step sampled, which
is still on the device when the step is staged (`backend.step_pipeline`). The decode graphs fill
those ids as their first kernel, from the sampled ids the previous replay left in the graph's
static buffer: row i takes sampled[fill_src[i]] when fill_src[i] >= 0 and keeps its staged id
otherwise. Inside the graph this costs no launch of its own between steps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _fill_kernel(ids_ptr, fill_src_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < n
    src = tl.load(fill_src_ptr + rows, mask=in_range, other=-1)
    filled = in_range & (src >= 0)
    token = tl.load(sampled_ptr + tl.where(filled, src, 0), mask=filled)
    tl.store(ids_ptr + rows, token, mask=filled)


def fill_placeholders(input_ids: torch.Tensor, fill_src: torch.Tensor, sampled: torch.Tensor) -> None:
    """input_ids[i] = sampled[fill_src[i]] where fill_src[i] >= 0 (all int64, contiguous)."""
    n = input_ids.numel()
    assert fill_src.numel() == n and input_ids.dtype == fill_src.dtype == sampled.dtype == torch.int64
    _fill_kernel[(triton.cdiv(n, BLOCK),)](input_ids, fill_src, sampled, n, BLOCK=BLOCK)

"""Merging split-K decode attention: the one formula every merger uses.

Each split of a head's context yields its normalised output o_s and the base-2 log-sum-exp lse_s
of its scores (-inf: the split had no keys). The head's output is

    out = sum_s w_s o_s / sum_s w_s,   w_s = exp2(lse_s - max_s lse_s),

and zero when no split had keys. A split of weight zero adds nothing even when its output was
never written (a fresh buffer may hold NaN there). Used by the decode kernel's last split
(`backend.attention.kernels.decode_partials`) and by the o projection's merge prologue
(`backend.kernels.gemv`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_splits(parts, lse):
    """parts [H, S, D], lse [H, S] (float32) -> the merged outputs [H, D], float32."""
    top = tl.max(lse, 1)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)[:, None])
    total = tl.sum(weight, 1)
    merged = tl.sum(tl.where(weight[:, :, None] > 0, parts * weight[:, :, None], 0.0), 1)
    return merged / tl.where(total > 0, total, 1.0)[:, None]

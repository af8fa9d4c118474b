"""Row-wise argmax of float logits [B, V], ties to the first index like `torch.argmax`.

Greedy sampling takes the argmax of every row of the logits each step. torch reduces one
vocabulary-wide row with few programs, slow enough to matter in a batch-1 decode step
(benchmarks/README.md). Here it is two short kernels: each program finds the maximum and its first
index in one CHUNK of one row, then one program per row picks the largest of its chunks' maxima
(the lowest index among equal ones, so ties still go to the first index). Logits are assumed
NaN-free (torch.argmax would pick a NaN).

In a decode CUDA graph the ids also go to the host: `host_out` names a ring of two rows in pinned
host memory, the row given by the `slot` the step's first kernel wrote, and the argmax then
advances the graph's replay counter (`backend.kernels.step_inputs`). There each row may also
exclude a few ids (`banned`, -1 = none): the end ids of a request short of its min_tokens, so
that greedy rows with that ban take the graph's argmax too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.pdl import Ordering, gdc_launch_dependents, gdc_wait, launch_options

CHUNK = 4096
CHUNK_ORDERING = Ordering("argmax_chunks", releases="after_wait")
ROW_ORDERING = Ordering("argmax_rows", releases="after_wait")


@triton.jit
def _chunk_max_kernel(
    x_ptr,
    max_ptr,
    index_ptr,
    banned_ptr,
    V,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    BANNED: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    for k in tl.static_range(BANNED):
        x = tl.where(cols == tl.load(banned_ptr + row * BANNED + k), float("-inf"), x)
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, cols, V), 0)
    tl.store(max_ptr + row * num_chunks + chunk, best)
    tl.store(index_ptr + row * num_chunks + chunk, first)


@triton.jit
def _row_max_kernel(
    max_ptr,
    index_ptr,
    out_ptr,
    host_out_ptr,
    host_stride,
    slot_ptr,
    replays_ptr,
    num_chunks,
    CHUNKS_PAD: tl.constexpr,
    TO_HOST: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_PAD)
    ok = chunks < num_chunks
    maxima = tl.load(max_ptr + row * num_chunks + chunks, mask=ok, other=float("-inf"))
    index = tl.load(index_ptr + row * num_chunks + chunks, mask=ok, other=0)
    best = tl.max(maxima, 0)
    big = 2147483647
    first = tl.min(tl.where(ok & (maxima == best), index, big), 0)
    tl.store(out_ptr + row, first.to(tl.int64))
    if TO_HOST:
        tl.store(host_out_ptr + tl.load(slot_ptr) * host_stride + row, first.to(tl.int64))
        if row == 0:  # the only program that reads or writes the counter
            tl.store(replays_ptr, tl.load(replays_ptr) + 1)


def argmax_rows(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    to_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [B, V] (float, last dimension contiguous) -> int64 [B] (into `out` when given).

    `to_host` = (ring int64 [2, >= B], slot int64 [1], replays int64 [1]): also write the ids to
    ring[slot], and add one to replays. `banned` int64 [B, K] (contiguous): ids row b must not
    take (-1: none); a row needs at least one id left."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] < 2**31
    rows, vocab = x.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    maxima = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.is_contiguous()
    if rows == 0:
        return out
    chunk_options = launch_options(CHUNK_ORDERING)
    if banned is not None:
        assert banned.shape[0] == rows and banned.dtype == torch.int64 and banned.is_contiguous()
    _chunk_max_kernel[(rows, num_chunks)](
        x,
        maxima,
        index,
        banned if banned is not None else out,
        vocab,
        x.stride(0),
        num_chunks,
        CHUNK=CHUNK,
        BANNED=banned.shape[1] if banned is not None else 0,
        num_warps=8,
        **chunk_options,
    )
    ring, slot, replays = to_host if to_host is not None else (out[None], out, out)
    assert ring.dtype == torch.int64 and ring.stride(1) == 1 and ring.shape[1] >= rows
    _row_max_kernel[(rows,)](
        maxima,
        index,
        out,
        ring,
        ring.stride(0) if to_host else 0,
        slot,
        replays,
        num_chunks,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        TO_HOST=to_host is not None,
        num_warps=1,
        **launch_options(ROW_ORDERING),
    )
    return out

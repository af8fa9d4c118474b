"""All-reduce through memory that both GPUs of a tensor-parallel pair map (torch's symmetric
memory), for the small tensors of decode steps.

Why: a decode step of a tensor-parallel model sums two [rows, hidden] partials per layer over
the ranks, and at a few rows NCCL's latency is most of an all-reduce's time. Here each rank
writes its partial into a buffer the peer maps, and one kernel (torch's one-shot all-reduce)
reads both buffers and sums them; the kernel's barriers let the next call reuse the buffer, also
when replayed from a CUDA graph. The two paths side by side: `benchmarks/all_reduce.py`, and
benchmarks/README.md, "Tensor parallelism on two H200s".

Only for two ranks: every rank must hold the same sum, and a + b is the same in either order;
with more ranks the kernel's summation order could differ between them. Larger tensors
(prefill) and other groups go through NCCL.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BUFFER_BYTES = 8 << 20  # 1,024 rows of a 4,096-wide bf16 hidden state


class PeerAllReduce:
    """`all_reduce(x)`: x summed over the two ranks in place, through a buffer of `dtype` that
    both map. `takes(x)`: whether x fits it (else the caller uses NCCL)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group  # torch's registry of names holds it weakly
        self.group_name = group_name = group.group_name
        self.buffer = symm_mem.empty(BUFFER_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group_name)  # collective: both ranks, same point

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == self.buffer.dtype
            and x.numel() <= self.buffer.numel()
            and x.is_contiguous()
            and x.device == self.buffer.device
        )

    def matmul_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x @ weight^T summed over the ranks, the product written straight into the buffer (no
        copy); None when it does not fit."""
        rows, out_features = x.numel() // x.shape[-1], weight.shape[0]
        if x.dtype != self.buffer.dtype or rows * out_features > self.buffer.numel():
            return None
        mine = self.buffer[: rows * out_features]
        torch.mm(x.reshape(rows, -1), weight.t(), out=mine.view(rows, out_features))
        summed = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
        torch.ops.symm_mem.one_shot_all_reduce_out(mine, "sum", self.group_name, summed.view(-1))
        return summed

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        mine = self.buffer[: x.numel()]
        mine.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(mine, "sum", self.group_name, x.view(-1))
        return x


def registered_group(backend, store, rank: int, size: int, name: str) -> dist.ProcessGroup:
    """`backend` (a ProcessGroupNCCL) as a process group torch can find by `name` (symmetric
    memory looks its group up by name)."""
    group = dist.ProcessGroup(store, rank, size)
    nccl = dist.ProcessGroup.BackendType.NCCL
    group._register_backend(torch.device("cuda"), nccl, backend)
    group._set_default_backend(nccl)
    group._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, group)
    return group


def peer_all_reduce(backend, store, rank: int, size: int, device, dtype, name: str):
    """A PeerAllReduce for a pair of GPUs that can map each other's memory, else None (logged)."""
    if size != 2 or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        return PeerAllReduce(registered_group(backend, store, rank, size, name), device, dtype)
    except Exception as exc:  # no peer access, or a torch without symmetric memory
        log.warning("all-reduce through NCCL only (no peer-mapped buffer: %s)", exc)
        return None


def unregister(name: str) -> None:
    drop = getattr(torch._C._distributed_c10d, "_unregister_process_group", None)
    if drop is not None:
        drop(name)

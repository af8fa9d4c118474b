"""Tensor parallelism: one rank's place in a group of processes that each hold a shard of the
model, and the collectives the layers call.

How the model is cut (Megatron's scheme): the fused q|k|v and gate|up projections are split by
output rows (column-parallel: each rank computes its heads, its slice of the intermediate size);
o and down by input columns (row-parallel: partial sums, then one all-reduce); the embedding and
the lm_head by vocabulary rows (vocab-parallel: a rank looks up the ids it holds, zeros for the
rest, and an all-reduce sums them; logits are gathered). KV heads split across ranks, or, with
fewer KV heads than ranks, each rank keeps the one KV head its query heads read.

Two groups: `group` carries the model's collectives (gloo on CPU, NCCL on CUDA), `cpu_group`
(gloo, always) the step inputs rank 0 broadcasts from host memory
(`backend.distributed.tp_workers`). On CPU both are one gloo group. They are process groups built
from a TCP store rather than
torch.distributed's default group, so a process can hold one (a test, an engine) and drop it.
Two GPUs that map each other's memory sum small tensors (decode steps) through it instead of
NCCL (`backend.distributed.peer_all_reduce`).

With one rank (`TensorParallel()`), the layers take none of these paths: no collective, no copy.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from backend.distributed.peer_all_reduce import PeerAllReduce, peer_all_reduce, unregister
from backend.model_config import ModelConfig

# How long a collective waits for a peer before it fails (a hung worker): a dead one fails it
# at once (its connection closes).
COLLECTIVE_TIMEOUT_S = 60.0


class TensorParallelError(RuntimeError):
    """A rank of the group is gone (or a collective failed): the group cannot compute again."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed backend (ProcessGroupGloo / ProcessGroupNCCL)
    cpu_group: object = None  # gloo, for host tensors
    peer: PeerAllReduce | None = None  # small all-reduces between two GPUs

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def part(self, total: int, what: str) -> tuple[int, int]:
        """This rank's (first, count) of `total` things split evenly; `what` names them in the
        error when they do not divide."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} must divide the model's {what} ({total})"
            )
        count = total // self.size
        return self.rank * count, count

    def vocab_part(self, vocab_size: int) -> tuple[int, int]:
        """(first id, rows) of this rank's vocabulary shard: ceil(vocab / size) rows on every
        rank (the last one padded past the vocabulary), so gathers take equal pieces."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank keeps: its share when they divide among the
        ranks; with fewer KV heads than ranks, the one its query heads read (replicated)."""
        self.part(num_heads, "attention heads")
        if num_kv_heads >= self.size:
            return self.part(num_kv_heads, "KV heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {self.size} must be a multiple of the model's KV heads "
                f"({num_kv_heads}) when it exceeds them"
            )
        return self.rank * num_kv_heads // self.size, 1

    def check_split(self, mc: ModelConfig) -> int:
        """Raise ValueError naming what this group cannot split of the model evenly; -> the KV
        heads of this rank."""
        kv_heads = self.kv_heads(mc.num_heads, mc.num_kv_heads)[1]
        self.part(mc.intermediate_size, "intermediate size")
        return kv_heads

    # ---- collectives (only called with size > 1) -------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.peer is not None and self.peer.takes(x):
            return self.peer.all_reduce(x)
        _wait(self.group.allreduce([x]))
        return x

    def matmul_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T summed over the ranks (a row-parallel layer's partial products)."""
        if self.peer is not None:
            summed = self.peer.matmul_all_reduce(x, weight)
            if summed is not None:
                return summed
        return self.all_reduce(F.linear(x, weight))

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's x [N, w] side by side, cut to `width` columns -> [N, width]."""
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        _wait(self.group.allgather([pieces], [x.contiguous()]))
        return torch.cat(pieces, dim=-1)[:, :width]

    def broadcast(self, x: torch.Tensor, host: bool = False) -> torch.Tensor:
        """x from rank 0 into x on every rank; `host`: a CPU tensor through the gloo group."""
        _wait((self.cpu_group if host else self.group).broadcast(x, 0))
        return x

    def min_over_ranks(self, values: list[int]) -> list[int]:
        """Each of the host `values` at its least over the ranks (through the gloo group)."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        tensor = torch.tensor(values)
        _wait(self.cpu_group.allreduce([tensor], options))
        return tensor.tolist()

    def close(self) -> None:
        """Forget this group's name (the peer all-reduce registered it); the groups go with
        their last reference."""
        if self.peer is not None:
            unregister(self.peer.group_name)


def _wait(work) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise TensorParallelError(f"a tensor-parallel collective failed: {exc}") from exc


def connect(
    rank: int, size: int, port: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> TensorParallel:
    """Join the group of `size` ranks whose rank 0 serves the store at 127.0.0.1:`port`
    (rank 0 creates it). NCCL on CUDA (the caller has set the rank's device), gloo otherwise;
    `dtype`: the activations' (the peer all-reduce's buffer)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout)
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, timeout)
    if device.type != "cuda":
        return TensorParallel(rank, size, cpu_group, cpu_group)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    peer = peer_all_reduce(
        group, dist.PrefixStore("peer", store), rank, size, device, dtype, f"tritonllm-tp-{port}"
    )
    return TensorParallel(rank, size, group, cpu_group, peer)

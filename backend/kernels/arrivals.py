"""Arrival counters: with them the last program of a group to finish (the splits of one
attention context, the K splits of one GEMM tile) learns, in the same kernel, that it is the one
to combine the group's partial results, so no second kernel is launched to do it.

Each launch leaves its counters at zero again, so one buffer per kernel serves every launch, CUDA
graph replays included (launches on one stream). Kernels get buffers of their own, as two kernels
may overlap under programmatic dependent launch. Buffers live as long as the process: a captured
graph holds their address.
"""

from __future__ import annotations

import torch

_held: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def arrival_counters(kernel: str, device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on `device` for `kernel`'s launches."""
    held = _held.setdefault((kernel, device), [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return held[-1]

"""Host-to-device transfer of a step's small index arrays in one copy (and of a sampler's
index list, `to_device`), never waiting for the device.

A step needs half a dozen small arrays on the device (token ids, positions, cache slots, block
tables, ...). Copying each from freshly pinned memory costs a pinned allocation and a transfer
apiece; instead they are packed, each 16-byte aligned and in its own dtype, into one persistent
pinned byte buffer, sent with a single non-blocking copy, and viewed on the device.

(Decode CUDA graph steps do without it: the graph reads its inputs from pinned memory itself,
`backend.runner.decode_graphs`.)

The host buffer may be rewritten only after its last copy finished: `StagingTurns` keeps two of
these, used in turn, and waits on each one's event before reusing it (the step may be packed while
the previous one still runs on the GPU).
"""

from __future__ import annotations

import math

import numpy as np
import torch

ALIGN = 16


class StagingBuffer:
    def __init__(self, device: torch.device, capacity: int = 1 << 20):
        self.device = device
        self.host = torch.empty(0, dtype=torch.uint8)
        self.dev = torch.empty(0, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            self._grow(capacity)

    def _grow(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // ALIGN) * ALIGN
        if total > self.host.numel():
            self._grow(max(total, 2 * self.host.numel()))
        host = self.host.numpy()
        for a, start in zip(arrays, offsets):
            host[start : start + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        self.dev[:total].copy_(self.host[:total], non_blocking=True)
        return [
            self.dev[start : start + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
            for a, start in zip(arrays, offsets)
        ]


class StagingTurns:
    """Two staging buffers used in turn: a step may be packed while the previous one's copy is
    still queued, and a buffer is refilled only once the device has done its last copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers = (StagingBuffer(device), StagingBuffer(device))
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._count = 0

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        turn = self._count % 2
        if self._done[turn] is not None:
            self._done[turn].synchronize()
        tensors = self._buffers[turn].to_device(arrays)
        self._count += 1
        if self.device.type == "cuda":
            done = self._done[turn] = self._done[turn] or torch.cuda.Event()
            done.record()
        return tensors


class RingedFields:
    """Named arrays laid out in one device buffer (each 16-byte aligned) and mirrored by the two
    slots of a pinned host ring, as numpy views (cheaper to write): a CUDA graph reads the buffer
    at fixed addresses, and a step is written into one slot while the other's copy may still be
    queued (`backend.runner.decode_graphs`, `backend.runner.mixed_graphs`). `fields`: (name, dtype,
    shape)."""

    def __init__(self, fields: list[tuple[str, torch.dtype, tuple[int, ...]]], device):
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in fields]
        aligned = [-(-size // ALIGN) * ALIGN for size in sizes]
        self.offsets = {name: sum(aligned[:i]) for i, (name, _, _) in enumerate(fields)}
        self.buffer = torch.zeros(sum(aligned), dtype=torch.uint8, device=device)
        pinned = device.type == "cuda"
        self.host_ring = torch.zeros(2, self.buffer.numel(), dtype=torch.uint8, pin_memory=pinned)
        self.device_views: dict[str, torch.Tensor] = {}
        self.host_views: tuple[dict[str, np.ndarray], ...] = ({}, {})
        for (name, dtype, shape), size in zip(fields, sizes):
            start = self.offsets[name]
            self.device_views[name] = self.buffer[start : start + size].view(dtype).view(shape)
            for slot in (0, 1):
                self.host_views[slot][name] = (
                    self.host_ring[slot, start : start + size].view(dtype).view(shape).numpy()
                )

    def attach(self, owner) -> None:
        """Give `owner` the layout as attributes: offsets, buffer, host_ring, host_fields (the
        slots' views) and each field's device view under its name."""
        owner.offsets, owner.buffer, owner.host_ring = self.offsets, self.buffer, self.host_ring
        owner.host_fields = self.host_views
        for name, view in self.device_views.items():
            setattr(owner, name, view)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list or array as a tensor on `device`, queued behind the step's kernels: a copy from
    pageable memory would make the host wait for every kernel queued before it."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return {
        np.dtype(np.int64): torch.int64,
        np.dtype(np.int32): torch.int32,
        np.dtype(np.bool_): torch.bool,
    }[np.dtype(dtype)]

"""Programmatic dependent launch (PDL, Hopper and later) for chains of small kernels.

A decode step at small batch is ~100 short kernels back to back; between two of them the GPU
drains one grid and ramps up the next. Launched with PDL, a kernel may start while the previous one
is still finishing: its programs wait (`gdc_wait`) for the previous grid's completion, and its
memory, before they read what it wrote or write anything, and signal (`gdc_launch_dependents`)
when the next kernel may begin launching. Kernels take a `PDL` constexpr and launch with
`**launch_options()`; without PDL (older GPUs, the CPU interpreter) both calls compile away.
"""
from __future__ import annotations

import functools
import os

import torch
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 (kernels use them)


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def launch_options() -> dict:
    """Launch keyword arguments: the PDL constexpr, and the launch attribute where supported."""
    return {"PDL": True, "launch_pdl": True} if enabled() else {"PDL": False}


__all__ = ["enabled", "launch_options", "gdc_wait", "gdc_launch_dependents"]

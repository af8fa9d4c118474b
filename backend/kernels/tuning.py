"""Kernel launch configs as data: per-device tables written by the sweeps in `benchmarks/`.

`tuning/<kernel>.json` maps a device name (`torch.cuda.get_device_name`) to where its entries
came from and to its configs, keyed by a shape key (`shape_key`):

    {"NVIDIA H100 80GB HBM3": {"source": "...", "configs": {"n=3072,k=2048,merge=0": {...}}}}

A kernel asks `lookup` once per shape and device and caches the answer; a device or shape the
table does not name gets the kernel's own default rule (CPU and the Triton interpreter always do).
The measurements behind the entries: benchmarks/README.md, "Kernel choices".
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

TABLES = Path(__file__).with_name("tuning")


def shape_key(**fields) -> str:
    """'name=value,...' in the given order; booleans as 0/1 (JSON object keys are strings)."""
    return ",".join(
        f"{name}={int(value) if isinstance(value, bool) else value}"
        for name, value in fields.items()
    )


def compiles_for_gpu(device: torch.device) -> bool:
    """Whether kernels on `device` are compiled for a CUDA GPU (where inline PTX runs), not run
    by the interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str | None:
    """The table key for `device`: the CUDA device's name; None on CPU or in the interpreter."""
    return torch.cuda.get_device_name(device) if compiles_for_gpu(device) else None


@functools.lru_cache(maxsize=None)
def table(kernel: str) -> dict:
    """device name -> {"source": ..., "configs": {shape key: config}} for `kernel`; {} without a
    file."""
    path = TABLES / f"{kernel}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def lookup(kernel: str, key: str, device: str | None) -> dict | None:
    """The table's config for `key` on `device` (a copy), or None where it has none."""
    config = table(kernel).get(device, {}).get("configs", {}).get(key) if device else None
    return dict(config) if config is not None else None


def write(kernel: str, device: str, configs: dict[str, dict | None], source: str) -> Path:
    """Merge `configs` (shape key -> config) into `device`'s entries of `kernel`'s table: other
    devices and other shapes keep theirs; a key mapped to None loses its entry. For the sweep
    scripts (`--write-tuning`)."""
    path = TABLES / f"{kernel}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    entry = data.setdefault(device, {"source": "", "configs": {}})
    entry["source"] = source
    entry["configs"].update({key: config for key, config in configs.items() if config is not None})
    for key in [key for key, config in configs.items() if config is None]:
        entry["configs"].pop(key, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    table.cache_clear()
    return path


def rows_bucket(m: int) -> int:
    """The row count a GEMM's tuned config is kept for: the next power of two, at least 16."""
    return max(16, 1 << (m - 1).bit_length())

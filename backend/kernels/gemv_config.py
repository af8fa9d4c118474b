"""Launch configs of the one-token GEMV (`backend.kernels.gemv`) and of the kernels that stream
weights its way (`backend.kernels.qkv_rope`): per device and weight shape from
`tuning/gemv.json` (keys with a stored format's name for quantized rows), else the default rule
tuned over one decode step's chain of products; checked against K and cached per shape."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch

from backend.kernels import tuning


def default_launch_config(n: int, k: int, merge: bool = False, weight_format=None) -> dict:
    """Tile and launch shape for devices without a table entry: the rule tuned on the H100 and
    H200 over one decode step's chain of products (benchmarks/README.md, "Kernel choices").
    4-bit rows (`weight_format` "int4g<group>") take K tiles of whole groups and no prefetch."""

    def widest_k(*choices):
        return next((b for b in choices if k % b == 0), 64)

    if weight_format is not None and weight_format.startswith("int4"):
        group = int(weight_format.removeprefix("int4g"))
        wide = n > 8192  # gate_up, lm_head: more rows a program, shorter K tiles
        tiles = [b for b in ((256, 128) if wide else (1024, 512, 256, 128)) if b % group == 0]
        return dict(
            BLOCK_N=32 if wide else 16 if merge else 8,  # merging: every program reads partials
            BLOCK_K=widest_k(*tiles) if tiles else group,
            num_warps=8 if merge else 4,
            num_stages=2,
            EARLY_LAUNCH=False,
            PREFETCH_K=0,  # the 4-bit stream reads its first tile before the wait itself
            SPLIT=1,  # programs along K (only where the operand needs no norm)
        )
    if n > 32768:  # the vocabulary-wide lm_head: wider tiles
        config = dict(
            BLOCK_N=16, BLOCK_K=widest_k(256, 128), num_warps=8, num_stages=2, EARLY_LAUNCH=True
        )
    elif merge:  # every program reads all split partials: fewer, wider programs
        config = dict(
            BLOCK_N=16,
            BLOCK_K=widest_k(512, 256, 128),
            num_warps=8,
            num_stages=4,
            EARLY_LAUNCH=True,
        )
    elif k <= 2048:
        config = dict(
            BLOCK_N=4, BLOCK_K=widest_k(512, 256, 128), num_warps=4, num_stages=4, EARLY_LAUNCH=True
        )
    else:  # long rows (the down projection): more warps per program
        config = dict(
            BLOCK_N=4,
            BLOCK_K=widest_k(512, 256, 128),
            num_warps=16,
            num_stages=2,
            EARLY_LAUNCH=True,
        )
    # Prefetch whole rows before the PDL wait, at most 128 values a thread, in whole tiles.
    held = 128 * 32 * config["num_warps"] // config["BLOCK_N"]
    prefetch = 1 << (min(k, held).bit_length() - 1)
    config["PREFETCH_K"] = prefetch if prefetch >= config["BLOCK_K"] else 0
    return config


def tuning_key(n: int, k: int, merge: bool = False, weight_format: str | None = None) -> str:
    """The shape key of `tuning/gemv.json` (stored formats add theirs: `StreamedWeight.format`)."""
    fields = dict(n=n, k=k, merge=merge)
    return tuning.shape_key(**fields, **({"weight": weight_format} if weight_format else {}))


@functools.lru_cache(maxsize=None)
def _tuned_config(
    n: int, k: int, merge: bool, device_name: str | None, weight_format: str | None = None
) -> Mapping:
    key = tuning_key(n, k, merge, weight_format)
    config = tuning.lookup("gemv", key, device_name) or default_launch_config(
        n, k, merge, weight_format
    )
    return MappingProxyType(_checked(k, config))


def launch_config(
    n: int,
    k: int,
    merge: bool = False,
    device_name: str | None = None,
    weight_format: str | None = None,
) -> dict:
    """Tile and launch shape for weight [n, k]: the table's on the named device, else the
    default."""
    return dict(_tuned_config(n, k, merge, device_name, weight_format))


def _checked(k: int, config: dict) -> dict:
    prefetch = config["PREFETCH_K"]
    assert k % config["BLOCK_K"] == 0 and prefetch <= k and prefetch % config["BLOCK_K"] == 0, (
        k,
        config,
    )
    assert prefetch & (prefetch - 1) == 0, "PREFETCH_K must be 0 or a power of two"
    return config


def checked_config(
    n: int,
    k: int,
    overrides: dict | None,
    merge: bool = False,
    device: torch.device | None = None,
    weight_format: str | None = None,
) -> Mapping:
    """The config for this shape on `device` with `overrides` applied, checked against K
    (without overrides, the one cached for the shape: no work per call)."""
    name = tuning.device_name(device) if device is not None else None
    tuned = _tuned_config(n, k, merge, name, weight_format)
    return _checked(k, {**tuned, **overrides}) if overrides else tuned

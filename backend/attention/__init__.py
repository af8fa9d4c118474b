"""Attention implementations behind one set of functions, picked by name.

Every implementation is a module with
    write_kv(key, value, k_cache, v_cache, slot_mapping) -> None
    paged_attention(query, k_cache, v_cache, meta, scale, window=None, sinks=0) -> output
and optionally, for decode-only steps whose consumer merges split-K attention itself,
    decode_partials(query, k_cache, v_cache, meta, scale, window=None, sinks=0, new_kv=None)
        -> SplitPartials (`new_kv`: the step's keys and values, for it to write into a
        quantized cache itself)
`window` (tokens, None = global) and `sinks` are a sliding-window layer's (reference.py's rule).
A quantized cache (`kv_dtype.py`: fp8 / int8) passes its scales to all three as `k_scales=`,
`v_scales=` ([blocks, tokens_per_block, kv_heads]); the functions quantize when they write and
de-quantize when they read.
- 'torch':  backend.attention.reference (plain torch; CPU and ground truth; no decode_partials)
- 'triton': backend.attention.triton_backend (Triton-language kernels; imported lazily)
- 'auto':   'triton' on CUDA when it imports, 'torch' otherwise
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from backend.attention.metadata import AttentionMetadata
from backend.kernels.split_partials import SplitPartials

logger = logging.getLogger(__name__)

_MODULES = {"torch": "backend.attention.reference", "triton": "backend.attention.triton_backend"}


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    paged_attention: Callable
    decode_partials: Callable | None = None


def get_attention_backend(
    name: str = "auto", device: str | torch.device = "cpu"
) -> AttentionBackend:
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            try:
                return get_attention_backend("triton", device)
            except ImportError as e:
                logger.warning("triton attention unavailable (%s); using the torch reference", e)
        return get_attention_backend("torch", device)
    if name not in _MODULES:
        raise ValueError(f"attention_backend must be one of {('auto', *_MODULES)}, got {name!r}")
    module = importlib.import_module(_MODULES[name])
    return AttentionBackend(
        name, module.write_kv, module.paged_attention, getattr(module, "decode_partials", None)
    )


__all__ = ["AttentionBackend", "AttentionMetadata", "SplitPartials", "get_attention_backend"]

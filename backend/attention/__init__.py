"""Attention implementations behind one pair of functions, picked by name.

Every implementation is a module with
    write_kv(key, value, k_cache, v_cache, slot_mapping) -> None
    paged_attention(query, k_cache, v_cache, meta, scale) -> output
- 'torch':  backend.attention.reference (plain torch; CPU and ground truth)
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

logger = logging.getLogger(__name__)

_MODULES = {"torch": "backend.attention.reference", "triton": "backend.attention.triton_backend"}


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    paged_attention: Callable


def get_attention_backend(name: str = "auto", device: str | torch.device = "cpu") -> AttentionBackend:
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
    return AttentionBackend(name, module.write_kv, module.paged_attention)


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]

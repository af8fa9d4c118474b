"""What the paged KV cache stores (`kv_cache_dtype`), and the torch rule for quantizing to it.

- auto: the model dtype, the keys and values as computed.
- fp8:  float8 e4m3 values, with one scale per token and kv head: s = amax / 448.
- int8: int8 values, with one scale per token and kv head: s = amax / 127.
The scales are dynamic (each head vector's own, computed when it is written) and live beside the
cache in a tensor of the same layout without the head_dim axis, kv_scales[layer, 0 | 1, block,
offset, kv_head], in bfloat16: two bytes with float32's range, so a head of 64 dims takes
64 + 2 bytes against bfloat16's 128. The scale is amax / QMAX rounded up to bfloat16, so no value
exceeds QMAX; the stored value is x / s (fp8: rounded to nearest even; int8: half up) and reads
back as value * s. The kernels (`kernels/kv_write.py`, `kernels/tile.py`) follow the same rule.
"""

from __future__ import annotations

import torch

from backend.config import KV_CACHE_DTYPES

KV_SCALE_DTYPE = torch.bfloat16
STORAGE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
MIN_SCALE = 2.0**-64  # an all-zero vector: any positive scale stores zeros


def storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a `kv_cache_dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return STORAGE.get(name, model_dtype)


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype has scales beside it."""
    return dtype in QMAX


def widens_to_float16(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """Whether the attention kernels read the cache's tiles as words widened to float16 and dot
    in float16 (`F16_TILES`, backend/attention/kernels/tile.py): an fp8 cache under a 16-bit
    query."""
    return cache_dtype == torch.float8_e4m3fn and query_dtype.itemsize == 2


def vector_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's key (or value) of one kv head, its scale included."""
    scale = KV_SCALE_DTYPE.itemsize if is_scaled(dtype) else 0
    return head_dim * dtype.itemsize + scale


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 values rounded up to the next bfloat16 (exact in bfloat16 after)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values [..., head_dim] in `dtype`, scales [...] bfloat16)."""
    qmax = QMAX[dtype]
    x = x.float()
    scale = round_up_to_bf16(torch.clamp(x.abs().amax(-1) / qmax, min=MIN_SCALE))
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    if not dtype.is_floating_point:
        y = torch.floor(y + 0.5)
    return y.to(dtype), scale.to(KV_SCALE_DTYPE)


def dequantize(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Cached values [..., head_dim] (and their scales [...], None when unscaled) -> float32."""
    out = values.float()
    return out if scales is None else out * scales.float()[..., None]


def check_kv_dtype(kv_dtype: torch.dtype, attention: str, device: torch.device) -> None:
    """Raise ValueError for an fp8 cache the Triton kernels cannot convert on this GPU."""
    if (
        kv_dtype == torch.float8_e4m3fn
        and attention == "triton"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ValueError(
            "kv_cache_dtype 'fp8' needs compute capability 8.9 or newer with the triton "
            "attention backend (float8 e4m3 conversions): use 'int8' or attention_backend 'torch'"
        )

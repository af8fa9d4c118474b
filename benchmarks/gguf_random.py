"""Random GGUF blocks with valid layouts, for the block decoders' and kernels' tests and timings."""

from __future__ import annotations

import numpy as np

from backend.gguf_blocks import BLOCK_TYPES

# Where each type keeps its float16 scales (random bytes there could be NaN or infinite).
SCALE_OFFSETS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q4_K": (0, 2),
    "Q6_K": (208,),
}


def random_rows(quant_type: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes]: random bytes with finite random float16 scales."""
    kind = BLOCK_TYPES[quant_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, kind.type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[quant_type]:
        scales = (rng.standard_normal(len(raw)) * 0.05).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * kind.type_size)

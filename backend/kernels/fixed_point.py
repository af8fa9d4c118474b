"""Order-independent sums across programs: float32 partials added as 64-bit fixed-point integers.

Several programs of one kernel adding into the same output with float atomics give a result that
depends on the order they land in, so a step would not be repeatable bit for bit. Integer addition
is associative: each program rounds its float32 partial to a multiple of 2**-FRACTION_BITS and adds
it with an int64 atomic, and the sum is the same whatever the order. With 32 fraction bits a
partial is exact to 1.2e-10 and the sum may reach 2**31 in magnitude, far beyond any activation.

A sum buffer is int64 zeros (`zeros`); the reader converts it back with `from_fixed` and clears it
for the next use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FRACTION_BITS = 32


@triton.jit
def to_fixed(x):
    """float32 -> int64 multiples of 2**-32, rounded to nearest."""
    return tl.floor(x * 4294967296.0 + 0.5).to(tl.int64)


@triton.jit
def from_fixed(q):
    """int64 fixed point -> float32 (the conversion rounds to nearest; the scaling is exact)."""
    return q.to(tl.float32) * 2.3283064365386963e-10


def zeros(size: int, device: torch.device | str) -> torch.Tensor:
    """An empty sum [1, size]."""
    return torch.zeros((1, size), dtype=torch.int64, device=device)


def to_float(sums: torch.Tensor) -> torch.Tensor:
    """A sum buffer's value as float32 tensors (for tests and checks)."""
    return sums.double().mul(2.0 ** -FRACTION_BITS).float()

"""Field checks shared by the engine's configuration and request parameters: each error names
the field and the rule, e.g. `max_tokens must be >= 1, got 0`."""
from __future__ import annotations

import math


def check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def check_token(name: str, token, vocab_size: int | None) -> None:
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"{name} token ids must be integers, got {token!r}")
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {token}")

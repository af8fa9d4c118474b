"""Per-request generation parameters and their validation.

Every rule violation raises `ValueError` naming the field and the rule, e.g.
`top_p must be in (0, 1], got 1.5`. Validation runs before a request reaches the scheduler.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16
    # 0 means greedy (exact argmax). Any positive value samples.
    temperature: float = 0.0
    top_k: int = 0            # 0 = disabled
    top_p: float = 1.0        # 1 = disabled
    min_p: float = 0.0        # 0 = disabled
    seed: int | None = None   # per-request generator; None = engine-wide generator
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_id: int | None = None          # None = the model's end-of-sequence id(s)
    ignore_end_id: bool = False
    stop_token_ids: list[list[int]] = field(default_factory=list)  # stop token sequences
    bad_token_ids: list[list[int]] = field(default_factory=list)   # banned token sequences
    embedding_bias: dict[int, float] = field(default_factory=dict)  # token id -> logit bias
    return_log_probs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
            if self.seed >= 2**64:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_float("presence_penalty", self.presence_penalty)
        _check_float("frequency_penalty", self.frequency_penalty)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.end_id is not None:
            _check_int("end_id", self.end_id, low=-1)
        for name in ("stop_token_ids", "bad_token_ids"):
            sequences = getattr(self, name)
            for seq in sequences:
                if not seq:
                    raise ValueError(f"{name} must not contain empty sequences")
                for token in seq:
                    _check_token(name, token, vocab_size)
        for token, bias in self.embedding_bias.items():
            _check_token("embedding_bias", token, vocab_size)
            _check_float("embedding_bias", bias)


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_token(name: str, token, vocab_size: int | None) -> None:
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"{name} token ids must be integers, got {token!r}")
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {token}")

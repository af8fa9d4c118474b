"""Per-request generation parameters and their validation.

Every rule violation raises `ValueError` naming the field and the rule, e.g.
`top_p must be in (0, 1], got 1.5`. Validation runs before a request reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.validation import check_float, check_int, check_token

MAX_TOP_LOG_PROBS = 20  # as OpenAI's top_logprobs: the per-position results stay small


@dataclass
class SamplingParams:
    max_tokens: int = 16
    # 0 means greedy (exact argmax). Any positive value samples.
    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1 = disabled
    min_p: float = 0.0  # 0 = disabled
    seed: int | None = None  # per-request generator; None = engine-wide generator
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_id: int | None = None  # None = the model's end-of-sequence id(s)
    ignore_end_id: bool = False
    stop_token_ids: list[list[int]] = field(default_factory=list)  # stop token sequences
    bad_token_ids: list[list[int]] = field(default_factory=list)  # banned token sequences
    embedding_bias: dict[int, float] = field(default_factory=dict)  # token id -> logit bias
    return_log_probs: bool = False
    # The k likeliest tokens of each generated position (and of each prompt position with
    # return_prompt_log_probs), under the same raw distribution as the log-probs; 0 = none.
    num_top_log_probs: int = 0
    # The log-prob of each prompt token given the tokens before it (position 0: 0.0).
    return_prompt_log_probs: bool = False
    # The LoRA adapter to run under, by its registered name (EngineConfig.lora_modules); None:
    # the base model.
    lora_name: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        check_int("max_tokens", self.max_tokens, low=1)
        check_int("num_top_log_probs", self.num_top_log_probs, low=0)
        if self.num_top_log_probs > MAX_TOP_LOG_PROBS:
            raise ValueError(
                f"num_top_log_probs must be <= {MAX_TOP_LOG_PROBS}, got {self.num_top_log_probs}"
            )
        if not isinstance(self.return_prompt_log_probs, bool):
            value = self.return_prompt_log_probs
            raise ValueError(f"return_prompt_log_probs must be true or false, got {value!r}")
        if self.lora_name is not None and (
            not isinstance(self.lora_name, str) or not self.lora_name
        ):
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        check_int("top_k", self.top_k, low=0)
        check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            check_int("seed", self.seed, low=0)
            if self.seed >= 2**64:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check_float("presence_penalty", self.presence_penalty)
        check_float("frequency_penalty", self.frequency_penalty)
        check_int("min_tokens", self.min_tokens, low=0)
        if self.end_id is not None:
            check_int("end_id", self.end_id, low=-1)
        for name in ("stop_token_ids", "bad_token_ids"):
            sequences = getattr(self, name)
            for seq in sequences:
                if not seq:
                    raise ValueError(f"{name} must not contain empty sequences")
                for token in seq:
                    check_token(name, token, vocab_size)
        for token, bias in self.embedding_bias.items():
            check_token("embedding_bias", token, vocab_size)
            check_float("embedding_bias", bias)

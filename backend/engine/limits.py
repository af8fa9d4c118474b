"""What one request may ask of this engine: checks that need only the engine's fixed sizes.

The executor runs them when a request is submitted. A caller in another process (the handle of
the engine process) runs them too, so a bad request is refused at once, with the same message,
without a round trip to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from backend.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_seq_len: int
    tokens_per_block: int
    total_blocks: int
    max_blocks_held: int | None = None  # sliding windows: the most a request holds at once
    lora_names: tuple[str, ...] = ()  # the adapters a request may name (lora_name)

    def check(self, prompt_ids: list[int], sampling: SamplingParams) -> SamplingParams:
        """Raise ValueError naming the rule a request breaks; else its params with max_tokens
        capped where max_seq_len ends generation anyway."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        for token in prompt_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(
                    f"prompt token ids must be integers in [0, {vocab}), got {token!r}"
                )
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; it must be shorter than "
                f"max_seq_len ({self.max_seq_len})"
            )
        sampling.validate(vocab)
        if sampling.lora_name is not None and sampling.lora_name not in self.lora_names:
            registered = (
                ", ".join(self.lora_names) or "none; the engine's lora_modules registers them"
            )
            raise ValueError(
                f"lora_name {sampling.lora_name!r} is not a registered LoRA adapter "
                f"(registered: {registered})"
            )
        # Capacity planning must see the true need.
        sampling = replace(
            sampling, max_tokens=min(sampling.max_tokens, self.max_seq_len - len(prompt_ids))
        )
        needed = -(-(len(prompt_ids) + sampling.max_tokens) // self.tokens_per_block)
        if self.max_blocks_held is not None:
            needed = min(needed, self.max_blocks_held)
        if needed > self.total_blocks:
            raise ValueError(
                f"request needs {needed} KV cache blocks (prompt {len(prompt_ids)} + max_tokens "
                f"{sampling.max_tokens} tokens) but the cache holds {self.total_blocks}; "
                "lower max_tokens or raise max_tokens_in_paged_kv_cache"
            )
        return sampling

"""Executor statistics, read by the Triton adapter for metrics and by tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.scheduling.kv_cache_manager import KVCacheStats


@dataclass
class ExecutorStats:
    kv: KVCacheStats
    num_waiting: int = 0
    num_running: int = 0
    num_completed: int = 0  # requests finished for any reason since start
    num_failed: int = 0
    num_cancelled: int = 0
    num_iterations: int = 0
    num_context_iterations: int = 0  # steps that computed part of some prompt (eager steps)
    num_preemptions: int = 0
    # Where the step thread's time goes (cumulative seconds): all of its steps; of that, waiting
    # for the device's sampled ids (the rest is host work); steps without prompt chunks that
    # follow such a step (steady decode: their time is one decode step, host or device bound).
    step_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    num_decode_streak_steps: int = 0
    decode_streak_seconds: float = 0.0
    num_prompt_tokens: int = 0  # cumulative, of finished requests
    num_generated_tokens: int = 0  # cumulative, delivered tokens
    last_num_context_requests: int = 0
    last_num_generation_requests: int = 0
    last_num_scheduled_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # Speculative decoding, cumulative: decodes that carried drafts, their drafts, and of those
    # the drafts accepted (vLLM's spec_decode num_drafts / num_draft_tokens / num_accepted_tokens).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

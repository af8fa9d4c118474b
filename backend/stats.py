"""Executor statistics, read by the Triton adapter for metrics and by tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.kv_cache_manager import KVCacheStats


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
    num_prompt_tokens: int = 0  # cumulative, of finished requests
    num_generated_tokens: int = 0  # cumulative, delivered tokens
    last_num_context_requests: int = 0
    last_num_generation_requests: int = 0
    last_num_scheduled_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)

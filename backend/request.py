"""A request as the engine sees it: its state while it is served, and what it emits."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch stays out of the processes that only read outputs
    from backend.logprobs import PromptLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and requeued
    RUNNING = "running"  # holds KV blocks, scheduled every step until it finishes
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens (or max_seq_len) reached
    STOP = "stop"  # a stop token sequence matched
    END_ID = "end_id"  # the end id was sampled
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Request:
    """Engine-side state of one request. Only the executor thread mutates it."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # With num_top_log_probs: each output token's position's top-k ids and log-probs.
    output_top_ids: list[list[int]] = field(default_factory=list)
    output_top_logprobs: list[list[float]] = field(default_factory=list)
    # With return_prompt_log_probs: collected as the prompt's chunks are computed.
    prompt_logprobs: PromptLogprobs | None = None
    status: RequestStatus = RequestStatus.WAITING
    # KV state: physical block ids, and how many tokens of `all_ids` are already in the cache.
    block_ids: list[int] = field(default_factory=list)
    # The block tables of the KV cache groups after the first
    # (`backend.scheduling.kv_cache_manager`): a model mixing global and windowed layers; empty
    # otherwise.
    group_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from reused blocks (first admission)
    num_reused_blocks: int = 0
    num_new_blocks: int = 0
    num_preemptions: int = 0
    # Overlap scheduling: the newest token's row in the sampled ids of the step still on the
    # device (`backend.engine.step`), or None. That token counts in num_tokens; it is in no id list.
    in_flight_row: int | None = None
    # Speculative decoding (`backend.speculative`): drafts proposed to follow the newest token,
    # for the scheduler to add to its next decode; and the drafts verified so far, and accepted.
    draft_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        """The tokens known on the host (an in-flight token is not among them)."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step reads one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, the one in flight included."""
        return len(self.prompt_ids) + len(self.output_ids) + (self.in_flight_row is not None)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, the one in flight included."""
        return len(self.output_ids) + (self.in_flight_row is not None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probs asked for and not all computed: every prompt position must be
        computed, none served from cached blocks."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.complete

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_tokens


@dataclass(slots=True)
class Chunk:
    """`num_tokens` tokens of `request` from position `start`, computed in one step: what the
    scheduler picks and the runner packs.

    `start` and `samples` are fixed when the step is scheduled; the request moves on after.
    `samples`: the chunk reaches the request's newest token, so the step samples the next one.
    `draft_ids`: a decode's drafts, its last tokens after the newest (counted in num_tokens); the
    step returns a row of logits for the newest token and for each of them.
    """

    request: Request
    start: int
    num_tokens: int
    samples: bool
    draft_ids: list[int] | tuple = ()

    @classmethod
    def of_sequence(
        cls, token_ids: list[int], block_ids: list[int], start: int = 0, samples: bool = True
    ) -> Chunk:
        """token_ids[start:] of a bare sequence held in `block_ids`, outside any scheduler (the
        runner's warm-up, tests, benchmarks)."""
        request = Request("sequence", list(token_ids), SamplingParams(), block_ids=block_ids)
        return cls(request, start, len(token_ids) - start, samples)


@dataclass(slots=True)
class RequestOutput:
    """What the engine delivers through the callback, once per step per request.

    Field order matters: the output processor builds these positionally (it is hot).
    """

    request_id: str
    new_token_ids: list[int]  # tokens produced since the last output
    new_logprobs: list[float]  # their log-probs (empty unless return_log_probs)
    num_output_tokens: int  # generated so far, including new_token_ids
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_reused_blocks: int = 0
    num_new_blocks: int = 0
    cum_logprob: float = 0.0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    rejected: str | None = (
        None  # refused unserved: "queue_full", "shutting_down" (retry) or "invalid"
    )
    # With num_top_log_probs: for each of new_token_ids, the top-k ids and log-probs of its
    # position (sorted, likeliest first); None otherwise.
    new_top_ids: list[list[int]] | None = None
    new_top_logprobs: list[list[float]] | None = None
    # With return_prompt_log_probs, in the first output only: one entry per prompt token, the
    # log-prob of token i given tokens 0..i-1; position 0 has no context and reads 0.0. With
    # num_top_log_probs also the top-k of the distribution predicting each prompt token
    # (position 0: empty lists). None in later outputs, and when the request ended before its
    # prompt was computed.
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    # Speculative decoding, so far: drafts verified, and of them accepted (through the engine
    # process: in full outputs, the final one included; a stream's middle outputs read 0).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

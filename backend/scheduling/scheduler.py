"""Which requests run each step, and how many tokens each: a token budget over waiting/running.

There are no prefill and decode phases. A request has `num_tokens` (prompt + outputs so far,
counting one still in flight with overlap scheduling: its value is not needed to schedule it) and
`num_computed_tokens` (already in the KV cache); a step gives it up to the difference, as `Chunk`s.
A prefill is many tokens, a decode one; both go into the same step.

Rules, in the order `schedule()` applies them:

1. Running requests first, oldest first. At most `max_num_tokens` new tokens per step in total.
   This is "decodes first".
2. Then waiting requests, strictly FCFS: when the head of the queue does not fit (token budget,
   `max_batch_size`, or KV blocks) nobody behind it is admitted this step. Later requests never
   overtake an earlier one, so every request is admitted once those before it have made room.
   Nothing is admitted in a step that had to preempt (it would only be preempted again).
3. Chunking. With `enable_chunked_context` a prefill larger than the remaining budget is cut to
   it. While requests wait behind it, a prefill is first cut to `long_prefill_token_threshold`
   (`EngineConfig.prefill_chunk_cap`) so that they can start in this step instead of after the
   whole prompt; what the budget has left after admission goes back to the cut prefills, in
   order, so no budget idles. Without chunking the prefill waits for a step with room; a prompt
   longer than `max_num_tokens` could never fit, so `add()` refuses it. The one exception is
   recomputation after a preemption (prompt + outputs may exceed `max_num_tokens`): it is
   always chunked.
4. Capacity, as TensorRT-LLM's batch scheduler policies:
   - `guaranteed_no_evict`: admit only if the pool can hold the request's whole life
     (blocks for `max_total_tokens`, minus blocks reused from the prefix cache; with sliding
     windows at most the blocks it holds at once) on top of what every running request may
     still grow into, in each KV cache group's pool (`backend.scheduling.kv_cache_manager`). Running
     requests can then always grow, so nothing is ever preempted.
   - `max_utilization`: admit with blocks for this step's tokens only. When a running request
     cannot get a block, the newest running request is preempted by recompute (blocks freed,
     computed tokens reset, back to the front of the queue) until it can, possibly itself.
5. `max_queue_size` bounds requests that have never been admitted; preempted ones coming back
   do not count against it.
6. Speculative decoding: a decode whose request carries drafts (`Request.draft_ids`) is scheduled
   with them, 1 + d tokens within the budget, when the pool has their blocks (never by
   preempting). They count as computed only once verified: `settle_drafts` keeps the accepted
   ones' KV and hands back the blocks of the rejected ones.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from backend.config import EngineConfig
from backend.request import Chunk, FinishReason, Request, RequestStatus
from backend.scheduling.kv_cache_manager import KVCacheManager, KVCacheStats, PrefixMatch


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue_size requests; the caller should retry later."""


@dataclass
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # during this schedule() call

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int | Sequence[int],
        tokens_per_block: int,
        attention_window: int | None | Sequence[int | None] = None,
        sink_tokens: int = 0,
    ):
        """`attention_window`: the most recent tokens any layer sees (None: some layer attends
        globally); blocks outside it and the sinks go back to the pool (KVCacheManager).
        Sequences: per KV cache group, its pool's blocks and its layers' window."""
        self.config = config
        self.kv = KVCacheManager(
            num_blocks,
            tokens_per_block,
            config.enable_kv_cache_reuse,
            window=attention_window,
            sink_tokens=sink_tokens,
            max_chunk_tokens=config.max_num_tokens,
        )
        self.no_evict = config.batch_scheduler_policy == "guaranteed_no_evict"
        self.shared_chunk_cap = config.prefill_chunk_cap()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self._requests: dict[str, Request] = {}  # every waiting or running request

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a new request. ValueError if it can never be served, QueueFullError if full."""
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already queued or running")
        if (
            not self.config.enable_chunked_context
            and request.num_prompt_tokens > self.config.max_num_tokens
        ):
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_num_tokens ({self.config.max_num_tokens}) and chunked context "
                "is disabled; enable_chunked_context or raise max_num_tokens"
            )
        short = self.kv.blocks_short(request.max_total_tokens)
        if short is not None:
            raise ValueError(
                f"request needs {short[0]} KV cache blocks but the cache holds {short[1]}"
            )
        limit = self.config.max_queue_size
        if limit and sum(r.first_scheduled_time is None for r in self.waiting) >= limit:
            raise QueueFullError(f"request queue is full (max_queue_size={limit}); retry later")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._requests[request.request_id] = request

    def finish(self, request: Request) -> None:
        """The request ended, for any reason: free its blocks and forget it. Idempotent."""
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED

    def cancel(self, request_id: str) -> Request | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.finish(request)
        if request.finish_reason is None:
            request.finish_reason = FinishReason.CANCELLED
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- capacity ------------------------------------------------------------------------------
    @property
    def total_blocks(self) -> int:
        return self.kv.total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return self.kv.blocks_needed(num_tokens)

    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats()

    def _reserved(self) -> list[int]:
        """Per KV cache group: blocks the running requests may still need to reach
        max_total_tokens."""
        reserved = [0] * len(self.kv.groups)
        for request in self.running:
            for g, blocks in enumerate(self.kv.blocks_to_grow(request)):
                reserved[g] += blocks
        return reserved

    def _fits_whole_life(self, request: Request, prefix: PrefixMatch, reserved: list[int]) -> bool:
        for g, group in enumerate(self.kv.groups):
            kept = self.kv.kept_prefix_blocks(prefix, g)
            revived = sum(1 for b in kept if group.pool.is_free(b))
            lifetime = self.blocks_needed(request.max_total_tokens) - prefix.num_blocks + revived
            lifetime = min(lifetime, group.max_blocks_held(request.max_total_tokens))
            if lifetime > group.pool.num_free - reserved[g]:
                return False
        return True

    def _may_chunk(self, request: Request) -> bool:
        return self.config.enable_chunked_context or request.num_preemptions > 0

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks and allocate their blocks (slots up to start + num_tokens)."""
        batch = SchedulerOutput()
        cut: list[tuple[int, int]] = []  # (chunk index, its uncut size) of prefills cut
        budget = self._schedule_running(batch, cut)
        if not batch.preempted:
            budget = self._admit_waiting(batch, budget, cut)
        self._extend_cut_prefills(batch, cut, budget)
        return batch

    def _schedule_running(self, batch: SchedulerOutput, cut: list[tuple[int, int]]) -> int:
        """Oldest first. Victims are the newest, so never one already scheduled this step.

        The common case, a decode whose last block still has a free slot, needs no allocation
        call: it is the hot loop at large batch sizes, so it is kept to a few attribute reads.
        """
        budget = self.config.max_num_tokens
        tokens_per_block = self.kv.tokens_per_block
        chunks = batch.chunks
        running = RequestStatus.RUNNING
        for request in list(self.running):
            if request.status is not running:  # preempted earlier this step
                continue
            computed = request.num_computed_tokens
            num_tokens = request.num_tokens
            # The last of max_total_tokens is never computed: nothing reads its KV. (A request
            # holds it unfinished only while it is in flight.)
            remaining = (
                min(num_tokens, len(request.prompt_ids) + request.sampling.max_tokens - 1)
                - computed
            )
            if request.draft_ids and remaining == 1 and budget > 1:
                chunk = self._decode_with_drafts(request, computed, budget)
                if chunk is not None:
                    chunks.append(chunk)
                    budget -= chunk.num_tokens
                    continue
            if (
                remaining == 1
                and budget > 0
                and computed < len(request.block_ids) * tokens_per_block
            ):
                chunks.append(Chunk(request, computed, 1, computed + 1 == num_tokens))
                budget -= 1
                continue
            num_new = min(remaining, budget)
            if num_new <= 0 or (num_new < remaining and not self._may_chunk(request)):
                continue
            uncut, num_new = num_new, self._shared_size(request, num_new)
            while not self.kv.allocate(request, num_new):
                if self.no_evict:
                    raise RuntimeError(
                        f"request {request.request_id} outgrew its KV block "
                        "reservation (more tokens than max_total_tokens?)"
                    )
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                if num_new < uncut:
                    cut.append((len(chunks), uncut))
                chunks.append(Chunk(request, computed, num_new, computed + num_new == num_tokens))
                budget -= num_new
        return budget

    def _decode_with_drafts(self, request: Request, computed: int, budget: int) -> Chunk | None:
        """A decode followed by its drafts, as many as the budget leaves room for; None when
        the pool cannot hold them (speculation never preempts: the plain decode is tried).
        Drafts are taken once: those of a later step are proposed after this one is verified."""
        drafts, request.draft_ids = request.draft_ids[: budget - 1], []
        if not self.kv.allocate(request, 1 + len(drafts)):
            return None
        return Chunk(request, computed, 1 + len(drafts), True, drafts)

    def _admit_waiting(self, batch: SchedulerOutput, budget: int, cut: list) -> int:
        """Admit FCFS while the head fits; returns the budget left."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_batch_size:
            return budget  # nothing can be admitted: skip the reservation sum
        reserved = self._reserved() if self.no_evict else []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            prefix = self.kv.match_prefix(request)
            remaining = request.num_tokens - prefix.num_tokens
            num_tokens = min(remaining, budget)
            if num_tokens < remaining and not self._may_chunk(request):
                break
            if self.no_evict and not self._fits_whole_life(request, prefix, reserved):
                break
            uncut, num_tokens = num_tokens, self._shared_size(request, num_tokens, behind=1)
            if not self.kv.allocate(request, num_tokens, prefix):
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            if self.no_evict:
                for g, blocks in enumerate(self.kv.blocks_to_grow(request)):
                    reserved[g] += blocks
            start = request.num_computed_tokens  # past the reused prefix
            if num_tokens < uncut:
                cut.append((len(batch.chunks), uncut))
            batch.chunks.append(
                Chunk(request, start, num_tokens, start + num_tokens == request.num_tokens)
            )
            budget -= num_tokens
        return budget

    def _shared_size(self, request: Request, num_tokens: int, behind: int = 0) -> int:
        """`num_tokens` cut to the shared chunk cap while requests wait behind this one (more
        than `behind` in the queue) and it may be chunked."""
        if (
            num_tokens > self.shared_chunk_cap
            and len(self.waiting) > behind
            and self._may_chunk(request)
        ):
            return self.shared_chunk_cap
        return num_tokens

    def _extend_cut_prefills(self, batch: SchedulerOutput, cut: list, budget: int) -> None:
        """The budget admission left goes back to the prefills cut for it, in order (no
        preemption for it: an extension the pool cannot hold is skipped)."""
        for index, uncut in cut:
            if budget <= 0:
                return
            chunk = batch.chunks[index]
            num_tokens = min(uncut, chunk.num_tokens + budget)
            if not self.kv.allocate(chunk.request, num_tokens):
                continue
            budget -= num_tokens - chunk.num_tokens
            end = chunk.start + num_tokens
            batch.chunks[index] = Chunk(
                chunk.request, chunk.start, num_tokens, end == chunk.request.num_tokens
            )

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, keep the outputs, requeue at the front."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def complete_step(self, batch: SchedulerOutput) -> None:
        """The model computed the chunks: advance each request and register its full blocks.

        Only a chunk that crossed a block boundary filled a block, so only those pay for hashing.
        """
        tokens_per_block = self.kv.tokens_per_block
        reuse = self.kv.enable_prefix_reuse
        requests = self._requests
        for chunk in batch.chunks:
            request = chunk.request
            if requests.get(request.request_id) is not request:  # ended meanwhile
                continue
            # Drafts count as computed once verified (`settle_drafts`), and only those accepted.
            end = chunk.start + chunk.num_tokens - len(chunk.draft_ids)
            request.num_computed_tokens = end
            if reuse and end // tokens_per_block != chunk.start // tokens_per_block:
                self.kv.cache_full_blocks(request)

    def settle_drafts(self, request: Request, num_accepted: int) -> None:
        """A decode's drafts were verified: the accepted ones' KV is the request's own (computed,
        hashed once their blocks are full), the rejected ones' blocks go back to the pool."""
        if self._requests.get(request.request_id) is not request:  # ended meanwhile
            return
        request.num_computed_tokens += num_accepted
        self.kv.truncate(request, request.num_computed_tokens)
        self.kv.cache_full_blocks(request)

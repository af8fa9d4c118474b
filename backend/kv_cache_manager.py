"""Block tables for requests over the block pool, with prefix reuse.

A request's block table is `request.block_ids`: logical block i (tokens i*B .. i*B+B-1, with
B = tokens_per_block) lives in physical block `block_ids[i]`. The manager grows it as the scheduler
schedules tokens, and hands back every block when the request ends or is preempted.

Prefix reuse: once a request has computed a full block, the block is registered under a hash
chained over the whole prefix (see `block_pool.hash_block`). A new request (or a preempted one
coming back, which recomputes prompt + outputs) first looks up the longest chain of registered
blocks matching its tokens and shares them instead of recomputing them.

A request that asks for prompt log-probs matches nothing until it has them all: they need the
logits of every prompt position, which a reused block would skip (its own blocks are still
registered for others as they fill).

The match is capped at floor((num_tokens - 1) / B) blocks: the last token must always be computed
(its logits give the next token), and matching whole blocks only means a request never writes
into a block that someone else holds. Every block a request writes to has ref_count == 1.

Sliding windows: with `window` (the most recent tokens any layer's query sees; None when a layer
attends globally) a block whose every token is older than the window of the next token to
compute, and that holds no sink token, is read by no layer again: it goes back to the pool and
its table entry becomes FREED (logical indices stay, so position p is still in entry p // B).
A released block keeps its content and prefix hash until evicted, and that content is still
exactly the KV of its chained prefix, so it may be matched again; a match still walks the chain
from the first block (an evicted block ends it), and takes only the matched blocks that the
request's own window still reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.block_pool import BlockHash, BlockPool, hash_block
from backend.request import Request

FREED = -1  # a block-table entry whose block went back to the pool (outside every window)


@dataclass
class KVCacheStats:
    max_blocks: int
    free_blocks: int
    used_blocks: int
    reused_blocks: int  # cumulative prefix-cache hits, in blocks
    tokens_per_block: int
    allocated_new_blocks: int = 0  # cumulative blocks handed out for fresh content


@dataclass
class PrefixMatch:
    """Cached blocks found for a request's leading tokens; not yet taken."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    tokens_per_block: int = 1

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.tokens_per_block


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        enable_prefix_reuse: bool = True,
        window: int | None = None,
        sink_tokens: int = 0,
        max_chunk_tokens: int | None = None,
    ):
        """`window`, `sink_tokens`: see the module docstring; `max_chunk_tokens` (the most tokens
        a step computes for one request) bounds the blocks a windowed request holds at once."""
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.pool = BlockPool(num_blocks)
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_reuse = enable_prefix_reuse
        self.window = window
        self.sink_blocks = -(-sink_tokens // tokens_per_block) if window is not None else 0
        self.max_chunk_tokens = max_chunk_tokens
        # Chain hashes of each request's full, computed blocks, in block order.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # Windows: each request's entries sink_blocks .. this index are FREED.
        self._freed_until: dict[str, int] = {}
        self.num_reused_blocks = 0
        self.num_allocated_new_blocks = 0

    @property
    def total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def max_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once: all of them, or with a
        window its sink blocks and those of the window before a chunk plus the chunk."""
        needed = self.blocks_needed(num_tokens)
        if self.window is None or self.max_chunk_tokens is None:
            return needed
        span = self.window - 1 + self.max_chunk_tokens
        return min(needed, self.sink_blocks + self.blocks_needed(span) + 1)

    def first_live_block(self, position: int) -> int:
        """The first block past the sinks that a query at `position` or later may read."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // self.tokens_per_block)

    def num_live_blocks(self, request: Request) -> int:
        """Blocks the request holds (its table's entries that are not FREED)."""
        freed = self._freed_until.get(request.request_id, 0) - self.sink_blocks
        return len(request.block_ids) - max(0, freed)

    def blocks_to_grow(self, request: Request) -> int:
        """Free blocks a running request may still take from the pool to reach
        max_total_tokens. With a window: at most what it may hold at once beyond the blocks it
        alone holds now (a shared block it releases returns nothing to the pool)."""
        fresh = max(0, self.blocks_needed(request.max_total_tokens) - len(request.block_ids))
        if self.window is None:
            return fresh
        own = sum(1 for b in request.block_ids if b != FREED and self.pool.ref_count(b) == 1)
        return min(fresh, max(0, self.max_blocks_held(request.max_total_tokens) - own))

    def kept_prefix_blocks(self, prefix: PrefixMatch) -> list[int]:
        """The matched blocks a request admitted with `prefix` takes: those its window reads."""
        lo, hi = self.sink_blocks, self.first_live_block(prefix.num_tokens)
        return [b for i, b in enumerate(prefix.block_ids) if not lo <= i < hi]

    def release_outside_window(self, request: Request) -> None:
        """Hand back the blocks that no query from num_computed_tokens on reads (windows only)."""
        if self.window is None:
            return
        start = max(self._freed_until.get(request.request_id, 0), self.sink_blocks)
        end = min(self.first_live_block(request.num_computed_tokens), len(request.block_ids))
        for i in range(start, end):
            self.pool.release(request.block_ids[i])
            request.block_ids[i] = FREED
        if end > start:
            self._freed_until[request.request_id] = end

    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest chain of cached full blocks equal to the request's leading tokens."""
        match = PrefixMatch(tokens_per_block=self.tokens_per_block)
        if not self.enable_prefix_reuse or request.block_ids or request.needs_prompt_logprobs:
            return match
        tokens = request.all_ids
        size = self.tokens_per_block
        parent = None
        for i in range((len(tokens) - 1) // size):
            block_hash = hash_block(parent, tokens[i * size : (i + 1) * size])
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            match.block_ids.append(block_id)
            match.block_hashes.append(block_hash)
            parent = block_hash
        return match

    def free_blocks_needed(
        self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> int:
        """Free blocks that `allocate(request, num_new_tokens, prefix)` would consume.

        Counts fresh blocks plus matched blocks that are currently evictable: taking those back
        moves them from free to used just like a fresh allocation.
        """
        held = len(request.block_ids)
        computed = request.num_computed_tokens
        revived = 0
        if prefix is not None:
            held += prefix.num_blocks
            computed += prefix.num_tokens
            revived = sum(1 for b in self.kept_prefix_blocks(prefix) if self.pool.is_free(b))
        fresh = max(0, self.blocks_needed(computed + num_new_tokens) - held)
        return fresh + revived

    def allocate(
        self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> bool:
        """Grow the block table to cover num_computed_tokens + num_new_tokens slots.

        With `prefix` (admission only: the request holds no blocks), the matched blocks are
        shared first and `num_computed_tokens` jumps to the matched length. All or nothing:
        returns False, changing nothing, when the pool cannot supply the blocks.
        """
        if prefix is not None and request.block_ids:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        self.release_outside_window(request)  # unread from now on, whatever happens next
        if self.free_blocks_needed(request, num_new_tokens, prefix) > self.pool.num_free:
            return False
        if prefix is not None:
            self._admit_prefix(request, prefix)
        num_fresh = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        num_fresh -= len(request.block_ids)
        for _ in range(num_fresh):
            request.block_ids.append(self.pool.allocate())
        request.num_new_blocks += max(0, num_fresh)
        self.num_allocated_new_blocks += max(0, num_fresh)
        return True

    def _admit_prefix(self, request: Request, prefix: PrefixMatch) -> None:
        lo, hi = self.sink_blocks, self.first_live_block(prefix.num_tokens)
        request.block_ids = list(prefix.block_ids)
        for i, block_id in enumerate(prefix.block_ids):  # take before allocations can evict
            if lo <= i < hi:
                request.block_ids[i] = FREED  # outside the window: not read, not taken
            else:
                self.pool.take(block_id)
        if hi > lo:
            self._freed_until[request.request_id] = min(hi, prefix.num_blocks)
        request.num_computed_tokens = prefix.num_tokens
        self._block_hashes[request.request_id] = list(prefix.block_hashes)
        request.num_reused_blocks += prefix.num_blocks
        self.num_reused_blocks += prefix.num_blocks
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = min(prefix.num_tokens, request.num_prompt_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed since the last call."""
        if not self.enable_prefix_reuse:
            return
        hashes = self._block_hashes.setdefault(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.tokens_per_block, len(request.block_ids))
        if num_full <= len(hashes):
            return
        size = self.tokens_per_block
        for i in range(len(hashes), num_full):
            block_hash = hash_block(
                hashes[-1] if hashes else None, request.tokens(i * size, (i + 1) * size)
            )
            hashes.append(block_hash)
            if request.block_ids[i] != FREED:
                self.pool.register(request.block_ids[i], block_hash)

    def free(self, request: Request) -> None:
        """Release every block of the request. Idempotent: an empty block table frees nothing.

        Blocks are released last-first so that, among evictable blocks, a prefix's tail is
        evicted before its head: a chain is only useful from its first block on.
        """
        for block_id in reversed(request.block_ids):
            if block_id != FREED:
                self.pool.release(block_id)
        request.block_ids = []
        self._block_hashes.pop(request.request_id, None)
        self._freed_until.pop(request.request_id, None)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            max_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free,
            used_blocks=self.pool.num_used,
            reused_blocks=self.num_reused_blocks,
            tokens_per_block=self.tokens_per_block,
            allocated_new_blocks=self.num_allocated_new_blocks,
        )

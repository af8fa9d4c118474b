"""One KV cache group: the block pool of a set of layers and its window rule.

Sliding windows: with `window` (the most recent tokens any layer's query sees; None when a layer
attends globally) a block whose every token is older than the window of the next token to
compute, and that holds no sink token, is read by no layer again: it goes back to the pool and
its table entry becomes FREED (logical indices stay, so position p is still in entry
p // tokens_per_block). A released block keeps its content and prefix hash until evicted, and
that content is still exactly the KV of its chained prefix, so it may be matched again; a match
still walks the chain from the first block (an evicted block ends it), and takes only the
matched blocks that the request's own window still reads.
"""

from __future__ import annotations

from backend.scheduling.block_pool import BlockPool

FREED = -1  # a block-table entry whose block went back to the pool (outside every window)


class KVCacheGroup:
    """One group of layers' block pool and window rule (`window` None: global)."""

    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        window: int | None,
        sink_tokens: int,
        max_chunk_tokens: int | None,
    ):
        self.pool = BlockPool(num_blocks)
        self.tokens_per_block = tokens_per_block
        self.window = window
        self.sink_blocks = -(-sink_tokens // tokens_per_block) if window is not None else 0
        self.max_chunk_tokens = max_chunk_tokens
        self.freed_until: dict[str, int] = {}  # entries sink_blocks .. this index are FREED

    def max_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once: all of them, or with a
        window its sink blocks and those of the window before a chunk plus the chunk."""
        return max_blocks_held(
            num_tokens, self.tokens_per_block, self.window, self.sink_blocks, self.max_chunk_tokens
        )

    def first_live_block(self, position: int) -> int:
        """The first block past the sinks that a query at `position` or later may read."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // self.tokens_per_block)

    def reads(self, index: int, position: int) -> bool:
        """Whether a query at `position` or later may read logical block `index`."""
        return index < self.sink_blocks or index >= self.first_live_block(position)

    def num_live(self, table: list[int], request_id: str) -> int:
        freed = self.freed_until.get(request_id, 0) - self.sink_blocks
        return len(table) - max(0, freed)

    def blocks_to_grow(self, table: list[int], max_total_tokens: int) -> int:
        fresh = max(0, -(-max_total_tokens // self.tokens_per_block) - len(table))
        if self.window is None:
            return fresh
        own = sum(1 for b in table if b != FREED and self.pool.ref_count(b) == 1)
        return min(fresh, max(0, self.max_blocks_held(max_total_tokens) - own))

    def release_outside_window(self, table: list[int], request_id: str, position: int) -> None:
        """Hand back the blocks that no query from `position` on reads (windows only)."""
        if self.window is None:
            return
        start = max(self.freed_until.get(request_id, 0), self.sink_blocks)
        end = min(self.first_live_block(position), len(table))
        for i in range(start, end):
            self.pool.release(table[i])
            table[i] = FREED
        if end > start:
            self.freed_until[request_id] = end

    def admit(self, table: list[int], request_id: str, matched: list[int], num_tokens: int):
        """Take the matched blocks a query at `num_tokens` reads; the others become FREED."""
        table[:] = [b if self.reads(i, num_tokens) else FREED for i, b in enumerate(matched)]
        for block_id in table:  # taken before allocations can evict
            if block_id != FREED:
                self.pool.take(block_id)
        hi = self.first_live_block(num_tokens)
        if hi > self.sink_blocks:
            self.freed_until[request_id] = min(hi, len(matched))

    def free(self, table: list[int], request_id: str) -> None:
        for block_id in reversed(table):
            if block_id != FREED:
                self.pool.release(block_id)
        self.freed_until.pop(request_id, None)


def max_blocks_held(
    num_tokens: int,
    tokens_per_block: int,
    window: int | None,
    sink_blocks: int,
    max_chunk_tokens: int | None,
) -> int:
    """See `KVCacheGroup.max_blocks_held` (also sizes the groups' pools: `model_runner`)."""
    needed = -(-num_tokens // tokens_per_block)
    if window is None or max_chunk_tokens is None:
        return needed
    span = window - 1 + max_chunk_tokens
    return min(needed, sink_blocks + -(-span // tokens_per_block) + 1)

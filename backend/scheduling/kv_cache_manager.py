"""Block tables for requests over the block pool, with prefix reuse.

A request's block table is `request.block_ids`: logical block i (tokens i*B .. i*B+B-1, with
B = tokens_per_block) lives in physical block `block_ids[i]`. The manager grows it as the scheduler
schedules tokens, and hands back every block when the request ends or is preempted.

Prefix reuse: once a request has computed a full block, the block is registered under a hash
chained over the whole prefix (see `block_pool.hash_block`). A new request (or a preempted one
coming back, which recomputes prompt + outputs) first looks up the longest chain of registered
blocks matching its tokens and shares them instead of recomputing them. A request under a LoRA
adapter chains from that adapter's root (`block_pool.root_hash`): it never shares blocks computed
under another adapter or the base model.

A request that asks for prompt log-probs matches nothing until it has them all: they need the
logits of every prompt position, which a reused block would skip (its own blocks are still
registered for others as they fill).

The match is capped at floor((num_tokens - 1) / B) blocks: the last token must always be computed
(its logits give the next token), and matching whole blocks only means a request never writes
into a block that someone else holds. Every block a request writes to has ref_count == 1.

Sliding windows and what each group frees: `backend.scheduling.kv_cache_group`.

Groups: a model mixing global and windowed layers (`ModelConfig.kv_cache_groups`) has a pool and
a block table per group: `request.block_ids` for the first (global) group and
`request.group_block_ids` for the others, all the same length (entry i: logical block i in that
group's pool). Every group gets a block for each new logical block; each frees by its own window.
A prefix matches for the first group's chain as above, cut to the longest length at which every
other group still holds the matched blocks the request's window would read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from backend.request import Request
from backend.scheduling.block_pool import BlockHash, hash_block, root_hash
from backend.scheduling.kv_cache_group import FREED, KVCacheGroup


@dataclass
class KVCacheStats:
    """Blocks of every group's pool together (a group's block holds only its own layers);
    reused and allocated count block-table entries (one block in each group)."""

    max_blocks: int
    free_blocks: int
    used_blocks: int
    reused_blocks: int  # cumulative prefix-cache hits, in blocks
    tokens_per_block: int
    allocated_new_blocks: int = 0  # cumulative blocks handed out for fresh content


@dataclass
class PrefixMatch:
    """Cached blocks found for a request's leading tokens; not yet taken. `block_ids`: the first
    group's; `group_block_ids`: the other groups', FREED where their window does not read."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    tokens_per_block: int = 1
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.tokens_per_block

    def table(self, group: int) -> list[int]:
        return self.block_ids if group == 0 else self.group_block_ids[group - 1]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int | Sequence[int],
        tokens_per_block: int,
        enable_prefix_reuse: bool = True,
        window: int | None | Sequence[int | None] = None,
        sink_tokens: int = 0,
        max_chunk_tokens: int | None = None,
    ):
        """`window`, `sink_tokens`: see the module docstring; `max_chunk_tokens` (the most tokens
        a step computes for one request) bounds the blocks a windowed request holds at once.
        Sequences for `num_blocks` and `window`: one group each (the first one global)."""
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        counts = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        windows = list(window) if isinstance(window, Sequence) else [window]
        if len(counts) != len(windows):
            raise ValueError(f"{len(counts)} block counts for {len(windows)} KV cache groups")
        self.groups = [
            KVCacheGroup(n, tokens_per_block, w, sink_tokens, max_chunk_tokens)
            for n, w in zip(counts, windows)
        ]
        first = self.groups[0]  # the only group unless layers mix global and windowed attention
        self.pool, self.window, self.sink_blocks = first.pool, first.window, first.sink_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_reuse = enable_prefix_reuse
        self.max_chunk_tokens = max_chunk_tokens
        # Chain hashes of each request's full, computed blocks, in block order.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self.num_reused_blocks = 0
        self.num_allocated_new_blocks = 0

    @property
    def total_blocks(self) -> int:
        return sum(group.pool.num_blocks for group in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(group.pool.num_free for group in self.groups)

    def tables(self, request: Request) -> list[list[int]]:
        """The request's block table in each group (created empty when missing)."""
        if len(request.group_block_ids) != len(self.groups) - 1:
            request.group_block_ids = [[] for _ in self.groups[1:]]
        return [request.block_ids, *request.group_block_ids]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def max_blocks_held(self, num_tokens: int, group: int = 0) -> int:
        return self.groups[group].max_blocks_held(num_tokens)

    def blocks_short(self, num_tokens: int) -> tuple[int, int] | None:
        """(blocks needed, blocks in the pool) of a group whose whole pool cannot hold a
        request of num_tokens tokens at once, or None."""
        for group in self.groups:
            needed = group.max_blocks_held(num_tokens)
            if needed > group.pool.num_blocks:
                return needed, group.pool.num_blocks
        return None

    def first_live_block(self, position: int) -> int:
        return self.groups[0].first_live_block(position)

    def num_live_blocks(self, request: Request, group: int = 0) -> int:
        """Blocks the request holds in `group` (its table's entries that are not FREED)."""
        return self.groups[group].num_live(self.tables(request)[group], request.request_id)

    def blocks_to_grow(self, request: Request) -> list[int]:
        """Per group: free blocks a running request may still take from the pool to reach
        max_total_tokens. With a window: at most what it may hold at once beyond the blocks it
        alone holds now (a shared block it releases returns nothing to the pool)."""
        return [
            group.blocks_to_grow(table, request.max_total_tokens)
            for group, table in zip(self.groups, self.tables(request))
        ]

    def kept_prefix_blocks(self, prefix: PrefixMatch, group: int = 0) -> list[int]:
        """The matched blocks of `group` a request admitted with `prefix` takes: those its
        window reads."""
        reads, position = self.groups[group].reads, prefix.num_tokens
        return [b for i, b in enumerate(prefix.table(group)) if reads(i, position)]

    def release_outside_window(self, request: Request) -> None:
        """Hand back the blocks that no query from num_computed_tokens on reads (windows only)."""
        for group, table in zip(self.groups, self.tables(request)):
            group.release_outside_window(table, request.request_id, request.num_computed_tokens)

    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest chain of cached full blocks equal to the request's leading tokens."""
        match = PrefixMatch(
            tokens_per_block=self.tokens_per_block, group_block_ids=[[] for _ in self.groups[1:]]
        )
        if not self.enable_prefix_reuse or request.block_ids or request.needs_prompt_logprobs:
            return match
        tokens = request.all_ids
        size = self.tokens_per_block
        pool = self.groups[0].pool
        parent = root_hash(request.sampling.lora_name)
        for i in range((len(tokens) - 1) // size):
            block_hash = hash_block(parent, tokens[i * size : (i + 1) * size])
            block_id = pool.lookup(block_hash)
            if block_id is None:
                break
            match.block_ids.append(block_id)
            match.block_hashes.append(block_hash)
            parent = block_hash
        if len(self.groups) > 1:
            self._match_other_groups(match)
        return match

    def _match_other_groups(self, match: PrefixMatch) -> None:
        """Cut the match to the longest length whose blocks every other group's window reads are
        still in that group's pool, and record them."""
        others = self.groups[1:]
        found = [[group.pool.lookup(h) for h in match.block_hashes] for group in others]
        n = match.num_blocks
        while n and not all(
            ids[i] is not None
            for group, ids in zip(others, found)
            for i in range(n)
            if group.reads(i, n * self.tokens_per_block)
        ):
            n -= 1
        del match.block_ids[n:], match.block_hashes[n:]
        position = n * self.tokens_per_block
        match.group_block_ids = [
            [ids[i] if group.reads(i, position) else FREED for i in range(n)]
            for group, ids in zip(others, found)
        ]

    def free_blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        prefix: PrefixMatch | None = None,
        group: int = 0,
    ) -> int:
        """Free blocks of `group` that `allocate(request, num_new_tokens, prefix)` would consume.

        Counts fresh blocks plus matched blocks that are currently evictable: taking those back
        moves them from free to used just like a fresh allocation.
        """
        held = len(request.block_ids)
        computed = request.num_computed_tokens
        revived = 0
        if prefix is not None:
            held += prefix.num_blocks
            computed += prefix.num_tokens
            pool = self.groups[group].pool
            revived = sum(1 for b in self.kept_prefix_blocks(prefix, group) if pool.is_free(b))
        fresh = max(0, self.blocks_needed(computed + num_new_tokens) - held)
        return fresh + revived

    def allocate(
        self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> bool:
        """Grow the block tables to cover num_computed_tokens + num_new_tokens slots.

        With `prefix` (admission only: the request holds no blocks), the matched blocks are
        shared first and `num_computed_tokens` jumps to the matched length. All or nothing:
        returns False, changing nothing, when a pool cannot supply the blocks.
        """
        if prefix is not None and request.block_ids:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        self.release_outside_window(request)  # unread from now on, whatever happens next
        for g, group in enumerate(self.groups):
            if self.free_blocks_needed(request, num_new_tokens, prefix, g) > group.pool.num_free:
                return False
        tables = self.tables(request)
        if prefix is not None:
            self._admit_prefix(request, prefix, tables)
        num_fresh = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        num_fresh -= len(request.block_ids)
        for group, table in zip(self.groups, tables):
            for _ in range(num_fresh):
                table.append(group.pool.allocate())
        request.num_new_blocks += max(0, num_fresh)
        self.num_allocated_new_blocks += max(0, num_fresh)
        return True

    def _admit_prefix(self, request: Request, prefix: PrefixMatch, tables: list[list[int]]):
        for g, (group, table) in enumerate(zip(self.groups, tables)):
            group.admit(table, request.request_id, prefix.table(g), prefix.num_tokens)
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
        tables = self.tables(request)
        root = root_hash(request.sampling.lora_name)
        for i in range(len(hashes), num_full):
            block_hash = hash_block(
                hashes[-1] if hashes else root, request.tokens(i * size, (i + 1) * size)
            )
            hashes.append(block_hash)
            for group, table in zip(self.groups, tables):
                if table[i] != FREED:
                    group.pool.register(table[i], block_hash)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Hand back the blocks past the first num_tokens slots (speculative decoding: rejected
        drafts' KV). They were never full and computed, so no hash names them."""
        keep = self.blocks_needed(num_tokens)
        for group, table in zip(self.groups, self.tables(request)):
            for block_id in reversed(table[keep:]):
                if block_id != FREED:
                    group.pool.release(block_id)
            del table[keep:]

    def free(self, request: Request) -> None:
        """Release every block of the request. Idempotent: an empty block table frees nothing.

        Blocks are released last-first so that, among evictable blocks, a prefix's tail is
        evicted before its head: a chain is only useful from its first block on.
        """
        for group, table in zip(self.groups, self.tables(request)):
            group.free(table, request.request_id)
        request.block_ids = []
        request.group_block_ids = [[] for _ in self.groups[1:]]
        self._block_hashes.pop(request.request_id, None)

    def stats(self) -> KVCacheStats:
        pools = [group.pool for group in self.groups]
        return KVCacheStats(
            max_blocks=sum(pool.num_blocks for pool in pools),
            free_blocks=sum(pool.num_free for pool in pools),
            used_blocks=sum(pool.num_used for pool in pools),
            reused_blocks=self.num_reused_blocks,
            tokens_per_block=self.tokens_per_block,
            allocated_new_blocks=self.num_allocated_new_blocks,
        )

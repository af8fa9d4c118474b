"""KV cache manager: unit tests for reuse/eviction rules, and a stateful property test that runs
random allocate / compute / append / free / preempt sequences against a model of cache content."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from backend.request import Request
from backend.sampling_params import SamplingParams
from backend.scheduling.block_pool import BlockPool, hash_block
from backend.scheduling.kv_cache_manager import KVCacheManager


def make_request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid, prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=max_tokens)
    )


def prefill(kv: KVCacheManager, request: Request, reuse: bool = True) -> None:
    """Admit the request and compute its whole prompt, as a scheduler + model would."""
    match = kv.match_prefix(request) if reuse else None
    computed = match.num_tokens if match else 0
    assert kv.allocate(request, request.num_tokens - computed, match)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


def test_prefix_hit_is_counted_and_skips_computation():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4)
    first = make_request("a", list(range(14)))  # 3 full blocks + 2 tokens
    prefill(kv, first)
    second = make_request("b", list(range(12)) + [99, 98, 97])
    match = kv.match_prefix(second)
    assert match.block_ids == first.block_ids[:3]
    assert kv.allocate(second, second.num_tokens - match.num_tokens, match)
    assert second.num_computed_tokens == 12
    assert second.num_reused_blocks == 3 and second.num_cached_prompt_tokens == 12
    assert second.num_new_blocks == 1
    assert kv.stats().reused_blocks == 3
    assert [kv.pool.ref_count(b) for b in second.block_ids] == [2, 2, 2, 1]


def test_match_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4)
    prefill(kv, make_request("a", list(range(8))))  # exactly 2 full blocks, both cached
    again = make_request("b", list(range(8)))
    assert kv.match_prefix(again).num_blocks == 1  # not 2: token 7 must be computed
    assert kv.match_prefix(make_request("c", list(range(9)))).num_blocks == 2


def test_same_block_after_a_different_prefix_is_not_a_hit():
    assert hash_block(hash_block(None, [1, 2]), [5, 6]) != hash_block(
        hash_block(None, [3, 4]), [5, 6]
    )
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2)
    prefill(kv, make_request("a", [1, 2, 5, 6, 7]))
    assert kv.match_prefix(make_request("b", [3, 4, 5, 6, 7])).num_blocks == 0
    assert kv.match_prefix(make_request("c", [1, 2, 5, 6, 7])).num_blocks == 2


def test_prefix_reuse_disabled_never_matches():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2, enable_prefix_reuse=False)
    prefill(kv, make_request("a", [1, 2, 3, 4, 5]))
    assert kv.match_prefix(make_request("b", [1, 2, 3, 4, 5])).num_blocks == 0
    assert kv.pool.num_evictable == 0


def test_eviction_is_least_recently_freed_first_and_tail_before_head():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=2)
    a, b = make_request("a", [1, 2, 3, 4, 0]), make_request("b", [5, 6, 7, 8, 0])
    for request in (a, b):  # each: 2 full cached blocks (+1 slot)
        assert kv.allocate(request, 4)
        request.num_computed_tokens = 4
        kv.cache_full_blocks(request)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_evictable == 4
    evicted = []
    for i in range(4):
        filler = make_request(f"f{i}", [42])
        assert kv.allocate(filler, 1)
        evicted.append(filler.block_ids[0])
    assert evicted == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]


def test_reused_block_moves_to_the_back_of_the_eviction_order():
    kv = KVCacheManager(num_blocks=6, tokens_per_block=2)
    a, b = make_request("a", [1, 2, 0]), make_request("b", [3, 4, 0])
    prefill(kv, a)
    prefill(kv, b)
    kv.free(a)
    kv.free(b)  # evictable, oldest first: a's full block, then b's
    a_again = make_request("a2", [1, 2, 9])
    prefill(kv, a_again)  # revives a's block
    kv.free(a_again)  # ... which is now the most recently freed
    assert kv.pool.num_evictable == 2
    filler = make_request("f", [7] * 2 * (kv.num_free_blocks - 1))
    assert kv.allocate(filler, filler.num_tokens)  # all plain blocks + one eviction
    assert kv.match_prefix(make_request("x", [3, 4, 0])).num_blocks == 0  # b's went first
    assert kv.match_prefix(make_request("y", [1, 2, 0])).num_blocks == 1


def test_plain_free_blocks_are_used_before_evicting_cached_ones():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=2)
    a = make_request("a", [1, 2, 3])
    prefill(kv, a)  # one full cached block, one partial
    kv.free(a)
    assert kv.pool.num_evictable == 1
    assert kv.allocate(make_request("f", [5, 6, 7, 8]), 4)  # two of the three plain blocks
    assert kv.match_prefix(make_request("b", [1, 2, 3])).num_blocks == 1
    assert kv.allocate(make_request("g", [5, 6, 7, 8]), 4)  # last plain block, then evict
    assert kv.match_prefix(make_request("c", [1, 2, 3])).num_blocks == 0


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=3, tokens_per_block=2)
    prefill(kv, make_request("a", [1, 2, 3, 4]))  # 2 blocks in use
    b = make_request("b", [1, 2, 9, 9, 9])
    match = kv.match_prefix(b)
    assert match.num_blocks == 1
    assert kv.free_blocks_needed(b, 3, match) == 2
    before = kv.stats()
    assert not kv.allocate(b, 3, match)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and kv.stats() == before


def test_revived_evictable_blocks_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=2, tokens_per_block=2)
    a = make_request("a", [1, 2, 3])
    prefill(kv, a)
    kv.free(a)  # block with [1, 2] evictable
    b = make_request("b", [1, 2, 3])
    match = kv.match_prefix(b)
    assert kv.free_blocks_needed(b, 1, match) == 2  # one revived + one fresh
    assert kv.allocate(b, 1, match) and kv.pool.num_free == 0


def test_concurrent_identical_prefixes_keep_one_indexed_copy():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2)
    a, b = make_request("a", [1, 2, 3]), make_request("b", [1, 2, 3])
    assert kv.allocate(a, 3) and kv.allocate(b, 3)  # both admitted before either computed
    for request in (a, b):
        request.num_computed_tokens = 3
        kv.cache_full_blocks(request)
    assert kv.pool.lookup(hash_block(None, [1, 2])) == a.block_ids[0]
    kv.free(b)
    kv.free(a)
    assert kv.pool.num_evictable == 1 and kv.pool.num_free == 8


def test_free_is_idempotent_and_pool_refuses_double_free():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=2)
    a = make_request("a", [1, 2, 3])
    prefill(kv, a)
    block = a.block_ids[0]
    kv.free(a)
    kv.free(a)
    assert kv.pool.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        kv.pool.release(block)


def test_pool_rejects_empty_and_exhaustion():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(1)
    pool.allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()


class KVCacheMachine(RuleBasedStateMachine):
    """Random request lifecycles against a shadow copy of what each cache slot holds.

    A slot's content is modelled as the full token prefix that produced it, so reading a
    request's block table back must give exactly its own prefixes: reused blocks included.
    """

    PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 3, 2, 1, 1, 2], [2, 2, 2, 2, 2, 2, 2, 2])

    @initialize(num_blocks=st.integers(1, 12), size=st.integers(1, 4), reuse=st.booleans())
    def setup(self, num_blocks, size, reuse):
        self.kv = KVCacheManager(num_blocks, size, enable_prefix_reuse=reuse)
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.pending: list[Request] = []  # not admitted (new or preempted)
        self.active: list[Request] = []  # holding blocks
        self.counter = 0

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(0, 8),
        suffix=st.lists(st.integers(0, 3), max_size=6),
    )
    def new_request(self, prefix, cut, suffix):
        prompt = prefix[:cut] + suffix or [0]
        self.counter += 1
        self.pending.append(make_request(f"r{self.counter}", prompt))

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 12))
    def admit(self, index, chunk):
        request = self.pending[index % len(self.pending)]
        match = self.kv.match_prefix(request)
        assert match.num_tokens < request.num_tokens  # the last token is always computed
        num_new = min(chunk, request.num_tokens - match.num_tokens)
        needed = self.kv.free_blocks_needed(request, num_new, match)
        if self.kv.allocate(request, num_new, match):
            self.pending.remove(request)
            self.active.append(request)
            self._compute(request, num_new)
        else:
            assert needed > self.kv.num_free_blocks and not request.block_ids

    @precondition(lambda self: self.active)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 12), token=st.integers(0, 3))
    def step(self, index, chunk, token):
        request = self.active[index % len(self.active)]
        if request.num_computed_tokens == request.num_tokens:
            request.output_ids.append(token)  # the token sampled last step
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self.kv.allocate(request, num_new):
            self._compute(request, num_new)

    def _compute(self, request: Request, num_new: int) -> None:
        size = self.kv.tokens_per_block
        tokens = request.all_ids
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            block = request.block_ids[pos // size]
            assert self.kv.pool.ref_count(block) == 1, "wrote into a shared block"
            self.slots[(block, pos % size)] = tuple(tokens[: pos + 1])
        request.num_computed_tokens += num_new
        self.kv.cache_full_blocks(request)

    @precondition(lambda self: self.active or self.pending)
    @rule(index=st.integers(0, 100))
    def finish_or_cancel(self, index):
        pool = self.active + self.pending
        request = pool[index % len(pool)]
        self.kv.free(request)
        self.kv.free(request)  # a second end frees nothing
        (self.active if request in self.active else self.pending).remove(request)

    @precondition(lambda self: self.active)
    @rule(index=st.integers(0, 100))
    def preempt(self, index):
        request = self.active.pop(index % len(self.active))
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.pending.append(request)

    @invariant()
    def counts_add_up(self):
        stats = self.kv.stats()
        assert stats.free_blocks + stats.used_blocks == stats.max_blocks

    @invariant()
    def ref_counts_equal_holders(self):
        holders = Counter(b for r in self.active for b in r.block_ids)
        for request in self.active:
            assert len(set(request.block_ids)) == len(request.block_ids)
        for block in self.kv.pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)
        assert self.kv.pool.num_used == len(holders)
        assert all(not r.block_ids for r in self.pending)

    @invariant()
    def block_tables_hold_the_right_content(self):
        size = self.kv.tokens_per_block
        for request in self.active:
            assert len(request.block_ids) * size >= request.num_computed_tokens
            tokens = request.all_ids
            for pos in range(request.num_computed_tokens):
                slot = (request.block_ids[pos // size], pos % size)
                assert self.slots[slot] == tuple(tokens[: pos + 1])

    @invariant()
    def hash_index_is_consistent(self):
        for block in self.kv.pool.blocks:
            if block.block_hash is not None:
                assert self.kv.pool.lookup(block.block_hash) == block.block_id

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for request in self.active + self.pending:
            self.kv.free(request)
        assert self.kv.pool.num_free == self.kv.total_blocks
        assert all(block.ref_count == 0 for block in self.kv.pool.blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_kv_cache_state_machine = KVCacheMachine.TestCase

"""Scheduler: simulated steps with a fake model that checks every KV slot it reads.

The fake model writes, for each computed position, the token prefix that produced it into a shadow
cache keyed by (block, offset); when a chunk samples it reads the request's whole context back
through the block table. Wrong block tables, stale blocks after preemption or wrong prefix reuse
all show up as a mismatch.
"""

from __future__ import annotations

import random

import pytest

from backend.config import EngineConfig
from backend.logprobs import PromptLogprobs
from backend.request import FinishReason, Request, RequestStatus
from backend.sampling_params import SamplingParams
from backend.scheduling.scheduler import QueueFullError, Scheduler

SYSTEM_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 5, 5, 5, 6, 6, 6, 6])


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(
        request_id=rid, prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=max_tokens)
    )


def make_scheduler(num_blocks: int = 64, tokens_per_block: int = 4, **config) -> Scheduler:
    return Scheduler(EngineConfig(**config), num_blocks, tokens_per_block)


def fake_token(request: Request) -> int:
    """Deterministic in the request's own history: a recomputed request must continue alike."""
    return (sum(request.all_ids) * 7 + len(request.all_ids)) % 11


class FakeModel:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.num_steps = 0
        self.admitted: list[str] = []  # request ids in order of first admission

    def step(self) -> list[Request]:
        """One executor iteration; returns the requests that finished."""
        sched, config = self.scheduler, self.scheduler.config
        out = self.last_output = sched.schedule()
        self.num_steps += 1
        assert out.num_batched_tokens <= config.max_num_tokens
        assert sched.num_running <= config.max_batch_size
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        size = sched.kv.tokens_per_block
        for chunk in out.chunks:
            request = chunk.request
            assert request.status is RequestStatus.RUNNING and chunk.num_tokens >= 1
            if request.request_id not in self.admitted:
                self.admitted.append(request.request_id)
            assert chunk.start == request.num_computed_tokens
            assert chunk.start + chunk.num_tokens <= request.num_tokens
            tokens = request.all_ids
            for pos in range(chunk.start, chunk.start + chunk.num_tokens):
                block = request.block_ids[pos // size]
                assert sched.kv.pool.ref_count(block) == 1, "writing into a shared block"
                self.slots[(block, pos % size)] = tuple(tokens[: pos + 1])
        for chunk in out.chunks:
            if chunk.samples:
                request = chunk.request
                for pos in range(request.num_tokens):
                    slot = (request.block_ids[pos // size], pos % size)
                    assert self.slots[slot] == tuple(request.all_ids[: pos + 1])
        sched.complete_step(out)
        finished = []
        for chunk in out.chunks:
            if chunk.samples:
                request = chunk.request
                request.output_ids.append(fake_token(request))
                if len(request.output_ids) == request.sampling.max_tokens:
                    sched.finish(request)
                    finished.append(request)
        stats = sched.kv_stats()
        assert stats.free_blocks + stats.used_blocks == stats.max_blocks
        return finished


def expected_outputs(request: Request) -> list[int]:
    clone = make_request("x", request.prompt_ids, request.sampling.max_tokens)
    while len(clone.output_ids) < clone.sampling.max_tokens:
        clone.output_ids.append(fake_token(clone))
    return clone.output_ids


def random_request(
    rng: random.Random, rid: str, max_prompt: int = 30, max_tokens: int = 12
) -> Request:
    prompt = list(rng.choice(SYSTEM_PROMPTS)) if rng.random() < 0.5 else []
    prompt += [rng.randrange(11) for _ in range(rng.randint(1, max_prompt))]
    return make_request(rid, prompt, rng.randint(1, max_tokens))


def simulate(
    scheduler: Scheduler,
    num_requests: int,
    seed: int,
    arrival_prob: float = 0.5,
    max_prompt: int = 30,
    max_steps: int = 20_000,
):
    """Random arrivals until num_requests were added, then drain. Returns (requests, latency)."""
    rng = random.Random(seed)
    model = FakeModel(scheduler)
    requests, arrival, done = [], {}, {}
    while len(done) < num_requests:
        assert model.num_steps < max_steps, "simulation did not drain"
        while len(requests) < num_requests and rng.random() < arrival_prob:
            request = random_request(rng, f"r{len(requests)}", max_prompt)
            scheduler.add(request)
            requests.append(request)
            arrival[request.request_id] = model.num_steps
        for request in model.step():
            done[request.request_id] = model.num_steps
    for request in requests:
        assert request.output_ids == expected_outputs(request)
        assert request.block_ids == []
    assert scheduler.kv_stats().used_blocks == 0 and not scheduler.has_work()
    assert model.admitted == [r.request_id for r in requests]  # FCFS: nobody overtook
    latency = {rid: done[rid] - arrival[rid] for rid in done}
    return requests, latency


POLICIES = ("guaranteed_no_evict", "max_utilization")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("reuse", [True, False])
def test_random_simulation_respects_budget_and_completes(policy, chunked, reuse):
    scheduler = make_scheduler(
        num_blocks=40,
        tokens_per_block=4,
        max_num_tokens=48,
        max_batch_size=6,
        batch_scheduler_policy=policy,
        enable_chunked_context=chunked,
        enable_kv_cache_reuse=reuse,
    )
    requests, _ = simulate(scheduler, 60, seed=len(policy) + 2 * chunked + 4 * reuse)
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    assert (scheduler.kv_stats().reused_blocks > 0) == reuse


def test_guaranteed_no_evict_never_preempts_with_a_tight_pool():
    scheduler = make_scheduler(
        num_blocks=14,
        tokens_per_block=4,
        max_num_tokens=32,
        max_batch_size=8,
        batch_scheduler_policy="guaranteed_no_evict",
    )
    model, rng = FakeModel(scheduler), random.Random(1)
    requests = [random_request(rng, f"r{i}", max_prompt=24, max_tokens=20) for i in range(150)]
    for request in requests:
        scheduler.add(request)
    steps_short_of_blocks = 0
    while scheduler.has_work():
        model.step()
        out = model.last_output
        steps_short_of_blocks += bool(
            scheduler.waiting and scheduler.num_running < 8 and out.num_batched_tokens < 32
        )
    assert steps_short_of_blocks > 100  # the pool really was the bottleneck
    assert all(r.num_preemptions == 0 for r in requests)
    assert all(r.output_ids == expected_outputs(r) for r in requests)


def test_max_utilization_preempts_under_a_tight_pool_and_still_completes():
    scheduler = make_scheduler(
        num_blocks=14,
        tokens_per_block=4,
        max_num_tokens=32,
        max_batch_size=8,
        batch_scheduler_policy="max_utilization",
    )
    requests, _ = simulate(scheduler, 120, seed=2, arrival_prob=0.8, max_prompt=24)
    assert sum(r.num_preemptions for r in requests) > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_no_starvation_every_request_finishes_within_a_bound(policy):
    scheduler = make_scheduler(
        num_blocks=24,
        tokens_per_block=4,
        max_num_tokens=32,
        max_batch_size=8,
        batch_scheduler_policy=policy,
    )
    _, latency = simulate(scheduler, 400, seed=3, arrival_prob=0.3)  # also checks FCFS
    assert len(latency) == 400
    assert max(latency.values()) <= 120, max(latency.values())


@pytest.mark.parametrize("policy", POLICIES)
def test_a_large_request_is_not_overtaken_by_a_stream_of_small_ones(policy):
    scheduler = make_scheduler(
        num_blocks=16,
        tokens_per_block=4,
        max_num_tokens=64,
        max_batch_size=16,
        batch_scheduler_policy=policy,
    )
    model = FakeModel(scheduler)
    big = make_request("big", list(range(40)), 20)  # 15 of the 16 blocks for its life
    for step in range(200):  # a new small request every step
        scheduler.add(make_request(f"s{step}", [step % 11, 1, 2], 6))
        if step == 3:
            scheduler.add(big)
        model.step()
        if big.is_finished:
            break
    assert big.is_finished and step < 60, step


def test_max_utilization_preempts_the_newest_and_requeues_it_at_the_front():
    scheduler = make_scheduler(
        num_blocks=4,
        tokens_per_block=2,
        max_num_tokens=64,
        batch_scheduler_policy="max_utilization",
    )
    old, new = make_request("old", [1, 2, 3], 5), make_request("new", [4, 5, 6], 5)
    later = make_request("later", [7], 1)
    for request in (old, new):
        scheduler.add(request)
    model = FakeModel(scheduler)
    model.step()  # both prefilled: 2 blocks each, pool full
    scheduler.add(later)
    model.step()  # both decode into their second block's free slot
    out = scheduler.schedule()  # old needs a third block: new is preempted
    assert out.preempted == [new] and [c.request for c in out.chunks] == [old]
    assert new.status is RequestStatus.WAITING and new.block_ids == []
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert list(scheduler.waiting) == [new, later]


def test_nothing_is_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(
        num_blocks=4,
        tokens_per_block=2,
        max_num_tokens=3,
        batch_scheduler_policy="max_utilization",
        enable_kv_cache_reuse=False,
    )
    old, new = make_request("old", [1], 5), make_request("new", [2], 5)
    scheduler.add(old)
    scheduler.add(new)
    model = FakeModel(scheduler)
    for _ in range(4):  # 4 tokens each: the pool is full
        model.step()
    out = scheduler.schedule()  # old preempts new, which frees 2 blocks
    assert out.preempted == [new] and [c.request for c in out.chunks] == [old]
    assert scheduler.kv.num_free_blocks == 1 and scheduler.waiting[0] is new
    # A 2-token chunk of new's recompute would fit the budget and the free block; it waits.


def test_recompute_longer_than_the_budget_is_chunked_even_without_chunked_context():
    scheduler = make_scheduler(
        num_blocks=8,
        tokens_per_block=2,
        max_num_tokens=8,
        batch_scheduler_policy="max_utilization",
        enable_chunked_context=False,
        enable_kv_cache_reuse=False,
    )
    older, newer = make_request("older", [2], 6), make_request("newer", [1] * 7, 6)
    scheduler.add(older)
    scheduler.add(newer)
    model = FakeModel(scheduler)
    while scheduler.has_work():
        assert model.num_steps < 100
        model.step()
    assert newer.num_preemptions >= 1 and newer.output_ids == expected_outputs(newer)
    assert older.output_ids == expected_outputs(older)


def test_a_request_preempts_itself_when_it_is_the_newest():
    scheduler = make_scheduler(
        num_blocks=3,
        tokens_per_block=2,
        max_num_tokens=64,
        batch_scheduler_policy="max_utilization",
        max_batch_size=1,
    )
    first = make_request("a", [1, 2, 3], 3)
    scheduler.add(first)
    model = FakeModel(scheduler)
    model.step()  # a: 2 blocks, one free left
    filler = make_request("f", [9, 9])
    scheduler.kv.allocate(filler, 2)  # someone else takes the last block
    model.step()  # a decodes into its 2nd block
    out = scheduler.schedule()
    assert out.preempted == [first] and out.chunks == []


def test_chunked_prefill_splits_a_long_prompt_and_decodes_go_first():
    scheduler = make_scheduler(max_num_tokens=8, enable_chunked_context=True)
    short, long = make_request("short", [1, 2], 10), make_request("long", list(range(20)), 2)
    scheduler.add(short)
    model = FakeModel(scheduler)
    model.step()
    scheduler.add(long)
    sizes = []
    while not long.output_ids:
        out = scheduler.schedule()
        assert out.chunks[0].request is short and out.chunks[0].num_tokens == 1
        chunk = out.chunks[1]
        sizes.append((chunk.num_tokens, chunk.samples))
        scheduler.complete_step(out)
        assert chunk.samples == (long.num_computed_tokens == 20)  # frozen when scheduled
        for c in out.chunks:
            if c.samples:
                c.request.output_ids.append(0)
    assert sizes == [(7, False), (7, False), (6, True)]
    assert long.first_scheduled_time >= long.arrival_time


def test_without_chunked_context_a_prefill_waits_for_room_and_long_prompts_are_refused():
    scheduler = make_scheduler(max_num_tokens=8, enable_chunked_context=False)
    with pytest.raises(ValueError, match="max_num_tokens"):
        scheduler.add(make_request("huge", list(range(9))))
    first, second = make_request("a", [1] * 5, 3), make_request("b", [2] * 5, 3)
    scheduler.add(first)
    scheduler.add(second)
    out = scheduler.schedule()
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(first, 5)]
    scheduler.complete_step(out)
    first.output_ids.append(0)
    out = scheduler.schedule()  # 1 decode + 5 tokens fit in 8
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(first, 1), (second, 5)]


def test_guaranteed_no_evict_reserves_whole_lives_and_the_queue_head_blocks_others():
    scheduler = make_scheduler(
        num_blocks=6, tokens_per_block=4, batch_scheduler_policy="guaranteed_no_evict"
    )
    big = make_request("big", [1] * 4, 12)  # 16 tokens: 4 blocks for its life
    head = make_request("head", [2] * 4, 8)  # 3 blocks: do not fit next to big
    small = make_request("small", [3] * 2, 2)  # 1 block: would fit, must not jump
    for request in (big, head, small):
        scheduler.add(request)
    model = FakeModel(scheduler)
    model.step()
    assert scheduler.kv_stats().used_blocks == 1  # only this step's block is allocated
    while not big.is_finished:
        assert head.status is RequestStatus.WAITING and small.status is RequestStatus.WAITING
        model.step()
    model.step()
    assert head.status is RequestStatus.RUNNING and small.status is RequestStatus.RUNNING


def test_max_utilization_admits_greedily():
    scheduler = make_scheduler(
        num_blocks=6, tokens_per_block=4, batch_scheduler_policy="max_utilization"
    )
    for rid in ("big", "head", "small"):
        scheduler.add(make_request(rid, [1, 2, 3, 4], 12))
    out = scheduler.schedule()
    assert len(out.chunks) == 3


def test_prefix_reuse_through_the_scheduler():
    scheduler = make_scheduler(num_blocks=16, tokens_per_block=4)
    model = FakeModel(scheduler)
    first = make_request("a", list(range(9)), 1)
    scheduler.add(first)
    model.step()
    assert first.is_finished
    again = make_request("b", list(range(9)), 1)
    scheduler.add(again)
    out = scheduler.schedule()
    assert [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [(8, 1, True)]
    assert again.num_reused_blocks == 2 and again.num_cached_prompt_tokens == 8
    assert scheduler.kv_stats().reused_blocks == 2


def test_a_request_asking_for_prompt_logprobs_reuses_no_cached_block_and_caches_its_own():
    """Prompt log-probs need the logits of every prompt position: the scheduler starts such a
    request at position 0 although its prefix is cached; its blocks are cached for the next."""
    scheduler = make_scheduler(num_blocks=16, tokens_per_block=4)
    model = FakeModel(scheduler)
    first = make_request("a", list(range(9)), 1)
    scheduler.add(first)
    model.step()
    asking = make_request("b", list(range(9)), 1)
    asking.prompt_logprobs = PromptLogprobs(num_prompt_tokens=9, k=0)
    scheduler.add(asking)
    out = scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 9)]
    assert asking.num_reused_blocks == 0 and scheduler.kv_stats().reused_blocks == 0
    asking.prompt_logprobs.num_done = 9  # what the runner records once the chunk is computed
    scheduler.complete_step(out)
    scheduler.finish(asking)
    later = make_request("c", list(range(9)), 1)
    scheduler.add(later)
    out = scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(8, 1)]
    assert later.num_reused_blocks == 2


def test_queue_full_raises_and_preempted_requests_do_not_count():
    scheduler = make_scheduler(
        num_blocks=2, tokens_per_block=2, max_queue_size=2, batch_scheduler_policy="max_utilization"
    )
    a, b = make_request("a", [1], 3), make_request("b", [2], 3)
    scheduler.add(a)
    scheduler.add(b)
    with pytest.raises(QueueFullError, match=r"request queue is full \(max_queue_size=2\)"):
        scheduler.add(make_request("c", [3], 1))
    assert issubclass(QueueFullError, RuntimeError)
    model = FakeModel(scheduler)
    for _ in range(3):  # the third step preempts b
        model.step()
    assert b.num_preemptions == 1 and list(scheduler.waiting) == [b]
    scheduler.add(make_request("c", [3], 1))
    scheduler.add(make_request("d", [4], 1))
    with pytest.raises(QueueFullError):
        scheduler.add(make_request("e", [5], 1))
    scheduler.cancel("c")
    scheduler.add(make_request("e", [5], 1))


def test_cancel_frees_blocks_and_forgets_the_request():
    scheduler = make_scheduler(num_blocks=8, tokens_per_block=4)
    running, waiting = make_request("run", list(range(10)), 4), make_request("wait", [1], 2)
    scheduler.add(running)
    scheduler.schedule()
    scheduler.add(waiting)
    assert scheduler.kv_stats().used_blocks == 3
    assert scheduler.cancel("run") is running
    assert running.block_ids == [] and scheduler.kv_stats().used_blocks == 0
    assert running.status is RequestStatus.FINISHED
    assert running.finish_reason is FinishReason.CANCELLED
    assert scheduler.cancel("wait") is waiting and scheduler.cancel("wait") is None
    assert scheduler.cancel("unknown") is None
    assert not scheduler.has_work() and scheduler.num_running == scheduler.num_waiting == 0
    scheduler.finish(running)  # idempotent
    assert scheduler.kv_stats().free_blocks == 8


def test_add_refuses_duplicates_and_requests_that_can_never_fit():
    scheduler = make_scheduler(num_blocks=2, tokens_per_block=4)
    scheduler.add(make_request("a", [1]))
    with pytest.raises(ValueError, match="already"):
        scheduler.add(make_request("a", [1]))
    with pytest.raises(ValueError, match="KV cache blocks"):
        scheduler.add(make_request("b", [1] * 6, 4))  # 10 tokens > 8 slots
    assert scheduler.blocks_needed(9) == 3 and scheduler.total_blocks == 2


def test_an_in_flight_token_is_scheduled_without_its_value_and_a_final_one_not_at_all():
    scheduler = make_scheduler()
    a, b = make_request("a", [1, 2, 3], max_tokens=4), make_request("b", [4, 5], max_tokens=1)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.complete_step(scheduler.schedule())
    a.in_flight_row, b.in_flight_row = 0, 1  # the step's tokens, still on the device
    assert (a.num_tokens, a.num_output_tokens, a.output_ids) == (4, 1, [])
    out = scheduler.schedule()
    # a decodes its in-flight token; b's is its last (max_tokens 1): nothing would read its KV.
    assert [(c.request, c.start, c.num_tokens, c.samples) for c in out.chunks] == [(a, 3, 1, True)]
    a.in_flight_row = None  # the step is finished: the value arrives
    a.output_ids.append(9)
    assert (a.num_tokens, a.num_output_tokens) == (4, 1)


def test_chunk_start_and_samples_are_fixed_at_scheduling_time():
    scheduler = make_scheduler()
    request = make_request("a", [1, 2, 3])
    scheduler.add(request)
    (chunk,) = scheduler.schedule().chunks
    request.num_computed_tokens = 3
    request.output_ids.append(7)
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (0, 3, True)


def _prefill_steps(sched: Scheduler, request: Request) -> list[int]:
    """Run steps until `request` has computed its prompt; the chunk sizes it got."""
    sizes = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        out = sched.schedule()
        sizes += [c.num_tokens for c in out.chunks if c.request is request]
        sched.complete_step(out)
    return sizes


def test_a_long_prompt_alone_takes_the_whole_budget():
    sched = make_scheduler(num_blocks=256, max_num_tokens=64, max_seq_len=512)
    long = make_request("long", list(range(200)) * 1)
    sched.add(long)
    assert _prefill_steps(sched, long) == [64, 64, 64, 8]


def test_a_short_request_starts_in_the_next_step_while_a_long_prompt_is_prefilled():
    """A short chat arriving while a long prompt is being prefilled starts in the next step: the
    long prompt's chunk is first cut to long_prefill_token_threshold, the newcomer takes what it
    needs, and the rest of the budget goes back to the long prompt. Without the cap (0) the
    newcomer waits for the whole prompt."""
    for threshold, waited in ((16, 0), (0, 2)):
        sched = make_scheduler(
            num_blocks=256,
            max_num_tokens=64,
            max_seq_len=512,
            long_prefill_token_threshold=threshold,
        )
        long = make_request("long", [i % 11 for i in range(250)])
        sched.add(long)
        first = sched.schedule()
        assert [c.num_tokens for c in first.chunks] == [64]  # alone: the whole budget
        sched.complete_step(first)
        short = make_request("short", [1, 2, 3])
        sched.add(short)
        steps = 0
        while True:
            out = sched.schedule()
            sched.complete_step(out)
            sizes = {c.request.request_id: c.num_tokens for c in out.chunks}
            if "short" in sizes:
                break
            steps += 1
        assert steps == waited
        if threshold:
            assert sizes == {"long": 61, "short": 3}  # the whole budget, shared


def test_long_prefill_token_threshold_is_checked():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)
    assert EngineConfig(max_num_tokens=8192).prefill_chunk_cap() == 2048
    assert (
        EngineConfig(max_num_tokens=8192, long_prefill_token_threshold=0).prefill_chunk_cap()
        == 8192
    )


def test_prompts_waiting_together_share_the_budget():
    """Two long prompts and a short one queued at once: the first two are cut to the cap so the
    third starts in the same step, and the budget left goes back to the first."""
    sched = make_scheduler(
        num_blocks=256, max_num_tokens=64, max_seq_len=512, long_prefill_token_threshold=16
    )
    for rid, n in (("a", 200), ("b", 200), ("c", 5)):
        sched.add(make_request(rid, [i % 11 for i in range(n)]))
    out = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [
        ("a", 43),
        ("b", 16),
        ("c", 5),
    ]

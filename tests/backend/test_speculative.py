"""Speculative decoding's parts on their own: the n-gram proposer, greedy verification, which
requests are speculated, the configuration's checks, a decode scheduled with its drafts and its
rollback, and the packed rows of its logits; preemption through the executor on a tiny model. The
default model end to end: test_speculative_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

from backend import generate
from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.request import Request
from backend.runner.step_packing import pack_step
from backend.sampling_params import SamplingParams
from backend.scheduling.block_pool import hash_block
from backend.scheduling.scheduler import Scheduler
from backend.speculative.ngram import NgramProposer
from backend.speculative.verification import accepted_tokens, may_speculate
from tests.tiny_models import TINY, make_tiny_model, random_prompts

# ---- the proposer ------------------------------------------------------------------------------


def test_proposes_what_followed_the_longest_suffix_ngram():
    proposer = NgramProposer(min_n=1, max_n=3, k=3)
    # The suffix 3-gram [7, 8, 9] occurred at 1; [8, 9] alone also occurred at 5 (followed by 4).
    tokens = [1, 7, 8, 9, 2, 8, 9, 4, 5, 7, 8, 9]
    assert proposer.propose(tokens) == [2, 8, 9]
    # Only 1-grams match: the first earlier occurrence of 9 is followed by 2.
    assert proposer.propose([1, 9, 2, 3, 4, 9]) == [2, 3, 4]


def test_the_first_occurrence_gives_all_k_drafts_in_a_loop():
    proposer = NgramProposer(min_n=2, max_n=4, k=5)
    loop = [10, 11, 12] * 4
    assert proposer.propose(loop) == [10, 11, 12, 10, 11]


def test_no_drafts_without_an_earlier_occurrence_or_room():
    proposer = NgramProposer(min_n=2, max_n=4, k=4)
    assert proposer.propose([1, 2, 3, 4, 5, 6]) == []  # no repeated suffix
    assert proposer.propose([1, 2, 9, 1, 2]) == [9, 1, 2]  # fewer than k: the copy ends at the end
    assert proposer.propose([1, 2, 3, 1, 2], limit=1) == [3]
    assert proposer.propose([1, 2, 3, 1, 2], limit=0) == []
    assert proposer.propose([5, 5]) == []  # a 2-gram needs a token before it to match
    assert NgramProposer(1, 1, 2).propose([5, 5]) == [5]


def test_a_suffix_shorter_than_min_n_is_not_looked_up():
    # [3, 9] would match at the start, but min_n is 3 and [2, 3, 9] never occurred before.
    assert NgramProposer(min_n=3, max_n=4, k=2).propose([3, 9, 5, 2, 3, 9]) == []


# ---- verification ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "drafts, targets, tokens, accepted",
    [
        ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7], 3),  # all accepted, then the target's next
        ([4, 5, 6], [4, 9, 6, 7], [4, 9], 1),  # the target's token replaces the first mismatch
        ([4, 5, 6], [8, 5, 6, 7], [8], 0),
        ([], [3], [3], 0),
    ],
)
def test_greedy_verification(drafts, targets, tokens, accepted):
    assert accepted_tokens(drafts, targets) == (tokens, accepted)


def test_which_requests_are_speculated():
    def request(**params) -> Request:
        return Request("r", [1, 2, 3], SamplingParams(max_tokens=8, **params))

    assert may_speculate(request())
    assert may_speculate(request(top_k=1, temperature=0.7))  # greedy too
    assert may_speculate(request(embedding_bias={4: 2.0}))  # the same on every row
    for params in (
        dict(temperature=0.7),
        dict(return_log_probs=True),
        dict(num_top_log_probs=2),
        dict(repetition_penalty=1.2),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(bad_token_ids=[[7]]),
        dict(min_tokens=2),
    ):
        assert not may_speculate(request(**params)), params
    reached = request(min_tokens=2)
    reached.output_ids = [5, 6]
    assert may_speculate(reached)  # the end ban no longer applies to any row


# ---- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(speculative_method="draft_model"), "speculative_method 'draft_model' is not"),
        (dict(speculative_method="medusa"), "speculative_method must be one of"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens must be >= 1"),
        (dict(prompt_lookup_min=0), "prompt_lookup_min must be >= 1"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max must be >= "),
        (dict(speculative_method="ngram", overlap_scheduling=True), "overlap_scheduling must be"),
    ],
)
def test_config_refuses_bad_speculation_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_speculation_flags_reach_the_config():
    args = generate.parse_args(
        ["--prompt", "hi", "--speculative-method", "ngram", "--num-speculative-tokens", "3"]
        + ["--prompt-lookup-min", "1", "--prompt-lookup-max", "5"]
    )
    config = generate.engine_config(args)
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 3)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 5)


# ---- scheduling, rollback and packing ----------------------------------------------------------


def decoding(scheduler: Scheduler, prompt: list[int], first: int, max_tokens: int = 16):
    """A request through its prefill, holding its first output token, about to decode."""
    request = Request("r", list(prompt), SamplingParams(max_tokens=max_tokens))
    scheduler.add(request)
    scheduler.complete_step(scheduler.schedule())
    request.output_ids.append(first)
    return request


def test_a_decode_takes_its_drafts_within_the_budget():
    scheduler = Scheduler(EngineConfig(max_num_tokens=3), 16, 4)
    request = decoding(scheduler, [1, 2, 3], first=4)
    request.draft_ids = [5, 6, 7, 8]
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.start, chunk.num_tokens, list(chunk.draft_ids)) == (3, 3, [5, 6])
    assert chunk.samples and len(request.block_ids) == scheduler.kv.blocks_needed(6)


def test_rejected_drafts_are_rolled_back_and_only_accepted_tokens_hashed():
    scheduler = Scheduler(EngineConfig(), 16, 4)
    prompt = [1, 2, 3, 4, 5, 6]
    request = decoding(scheduler, prompt, first=7)
    request.draft_ids = [8, 9, 10, 11, 12]  # positions 7..11: three blocks in all
    batch = scheduler.schedule()
    assert batch.chunks[0].num_tokens == 6 and len(request.block_ids) == 3
    scheduler.complete_step(batch)
    assert request.num_computed_tokens == 7  # the drafts are not computed until verified
    # The target agreed with the first draft only: 8 is kept, then its own 20.
    request.output_ids += [8, 20]
    scheduler.settle_drafts(request, 1)
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    assert len(request.block_ids) == 2  # the block of positions 8..11 went back
    assert scheduler.kv.pool.num_free == 16 - 2
    hashes = scheduler.kv._block_hashes["r"]
    first = hash_block(None, [1, 2, 3, 4])
    assert hashes == [first, hash_block(first, [5, 6, 7, 8])]
    # The next decode computes the target's token where the rejected draft 9 was.
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft_ids) == (8, 1, ())
    scheduler.finish(request)
    assert scheduler.kv.pool.num_free == 16


def test_drafts_are_left_out_when_the_pool_cannot_hold_them():
    scheduler = Scheduler(EngineConfig(batch_scheduler_policy="max_utilization"), 2, 4)
    request = decoding(scheduler, [1, 2, 3, 4, 5, 6], first=7, max_tokens=2)
    request.draft_ids = [8, 9, 10]  # would need a third block (the engine caps them before)
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.num_tokens, chunk.draft_ids) == (1, ())
    assert not scheduler.running[0].num_preemptions


def test_a_drafted_decode_packs_its_drafts_and_samples_every_row():
    scheduler = Scheduler(EngineConfig(), 16, 4)
    drafted = decoding(scheduler, [1, 2, 3], first=4)
    drafted.draft_ids = [5, 6]
    other = Request("o", [7, 8], SamplingParams(max_tokens=4))
    scheduler.add(other)
    chunks = scheduler.schedule().chunks
    packed = pack_step(chunks, 4, 64, 1)
    assert packed.input_ids.tolist() == [4, 5, 6, 7, 8] and packed.has_drafts
    assert packed.positions.tolist() == [3, 4, 5, 0, 1]
    assert packed.logits_indices.tolist() == [0, 1, 2, 4]  # 1 + 2 rows, then the prefill's last
    plain = pack_step([chunks[1]], 4, 64, 1)
    assert np.array_equal(plain.logits_indices, [1]) and not plain.has_drafts


# ---- preemption, end to end ---------------------------------------------------------------------


def test_preempted_speculating_requests_give_the_unspeculated_output(tmp_path):
    """A pool of 40 blocks of 8 tokens holds a few of these requests: max_utilization preempts
    requests whose blocks held drafts, and they recompute to the same tokens. Some requests
    have an embedding bias (on every verified row) or min_tokens (speculated once reached)."""
    make_tiny_model("llama", tmp_path)
    prompts = [p[:6] * 4 + p for p in random_prompts(12, TINY["vocab_size"], seed=3, low=20)]
    params = [
        SamplingParams(max_tokens=40, ignore_end_id=True),
        SamplingParams(max_tokens=40, ignore_end_id=True, embedding_bias={5: 1.0, 7: 0.5}),
        SamplingParams(max_tokens=40, min_tokens=10, end_id=prompts[2][0]),
    ] * 4
    outputs, stats = [], []
    for method in (None, "ngram"):
        config = EngineConfig(
            model_path=str(tmp_path),
            device="cpu",
            tokens_per_block=8,
            max_tokens_in_paged_kv_cache=320,
            batch_scheduler_policy="max_utilization",
            speculative_method=method,
        )
        executor = Executor(config)
        try:
            results = executor.generate(prompts, params, 300)
            outputs.append([r["token_ids"] for r in results])
            stats.append(executor.stats())
        finally:
            executor.shutdown()
    assert outputs[1] == outputs[0]
    for kind in range(3):  # drafts accepted for each kind of parameters
        assert sum(r["accepted_draft_tokens"] for r in results[kind::3]) > 0
    assert stats[1].num_preemptions > 0 and stats[1].num_accepted_draft_tokens > 0
    assert stats[1].kv.free_blocks == stats[1].kv.max_blocks

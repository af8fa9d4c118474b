"""Sliding-window attention and attention sinks in the paged cache: a tiny random-weight Mistral
with a window equals transformers token for token (batched, chunked prefill, prefix reuse,
prompts several windows long); blocks wholly outside the window go back to the pool."""

from __future__ import annotations

import random
from itertools import chain

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.model_config import ModelConfig
from backend.request import Request
from backend.sampling_params import SamplingParams
from backend.scheduling.kv_cache_group import FREED
from backend.scheduling.scheduler import Scheduler
from tests.hf_reference import hf_greedy
from tests.tiny_models import random_prompts, save_tiny_hf_model

WINDOW = 24
BLOCK = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-window")
    hf = save_tiny_hf_model(path, "mistral", sliding_window=WINDOW)
    return hf, path


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_end_id=True))


def serve(path, prompts, max_tokens, **config) -> tuple[list[dict], Executor]:
    executor = Executor(
        EngineConfig(model_path=str(path), device="cpu", tokens_per_block=BLOCK, **config)
    )
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_end_id=True, return_log_probs=True)
        return executor.generate(prompts, params, timeout=600), executor
    finally:
        executor.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap scheduling"])
def test_mistral_window_matches_transformers_batched_and_chunked(mistral, overlap):
    hf, path = mistral
    prompts = random_prompts(6, 640, seed=3, low=5, high=20)  # within the window
    prompts += random_prompts(6, 640, seed=4, low=3 * WINDOW + 1, high=110)  # > 3 windows
    results, executor = serve(
        path, prompts, 20, max_num_tokens=40, max_batch_size=12, overlap_scheduling=overlap
    )
    for prompt, result in zip(prompts, results):
        tokens, logprobs = hf_greedy(hf, prompt, 20)
        assert result["token_ids"] == tokens
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    stats = executor.stats().kv
    assert stats.free_blocks == stats.max_blocks


def test_window_override_changes_long_prompts_only(mistral):
    """`max_attention_window_size` overrides the model's window: full attention matches
    transformers within the window and departs from it beyond (so the test above can fail)."""
    hf, path = mistral
    short = random_prompts(2, 640, seed=5, low=4, high=12)
    long = random_prompts(4, 640, seed=6, low=3 * WINDOW + 1, high=110)
    results, _ = serve(path, short + long, 12, max_attention_window_size="4096")
    assert [r["token_ids"] for r in results[:2]] == [hf_greedy(hf, p, 12)[0] for p in short]
    assert [r["token_ids"] for r in results[2:]] != [hf_greedy(hf, p, 12)[0] for p in long]


# ---- blocks outside the window go back to the pool (scheduler-level, simulated steps) --------


def fake_token(request: Request) -> int:
    return (sum(request.all_ids) * 7 + len(request.all_ids)) % 11


def simulate(
    scheduler: Scheduler, requests: list[Request], window: int, sinks: int, slots=None
) -> dict:
    """Run the requests to the end with a fake model that records, per cache slot, the prefix
    that produced it, and checks every key a chunk's queries read (the sinks and the last
    window - sinks tokens) through the block table. Returns each request's peak of held blocks."""
    size, recent = scheduler.kv.tokens_per_block, window - sinks
    slots, peak = {} if slots is None else slots, {}
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work():
        out = scheduler.schedule()
        for chunk in out.chunks:
            request, end = chunk.request, chunk.start + chunk.num_tokens
            tokens = request.all_ids
            for pos in range(chunk.start, end):
                block = request.block_ids[pos // size]
                assert block != FREED and scheduler.kv.pool.ref_count(block) == 1
                slots[(block, pos % size)] = tuple(tokens[: pos + 1])
            first = max(0, chunk.start - recent + 1)
            for pos in chain(range(min(sinks, first)), range(first, end)):
                block = request.block_ids[pos // size]
                assert block != FREED, f"position {pos} is read but its block was freed"
                assert slots[(block, pos % size)] == tuple(tokens[: pos + 1])
            live = scheduler.kv.num_live_blocks(request)
            assert live == len([b for b in request.block_ids if b != FREED])
            peak[request.request_id] = max(peak.get(request.request_id, 0), live)
        scheduler.complete_step(out)
        for chunk in out.chunks:
            if chunk.samples:
                request = chunk.request
                request.output_ids.append(fake_token(request))
                if len(request.output_ids) >= request.sampling.max_tokens:
                    scheduler.finish(request)
    assert scheduler.kv.num_free_blocks == scheduler.total_blocks  # every block came back
    return peak


def windowed_scheduler(num_blocks: int, window: int, sinks: int = 0, **config) -> Scheduler:
    return Scheduler(
        EngineConfig(**config),
        num_blocks,
        BLOCK,
        attention_window=window - sinks,
        sink_tokens=sinks,
    )


@pytest.mark.parametrize("sinks", [0, 4])
def test_long_prompt_holds_only_the_window_blocks(sinks):
    """A 200-token prompt + 30 tokens (29 blocks of 8) with a window of 24 and chunks of 40:
    it never holds more than the sink block, the window before a chunk and the chunk (at most
    9 or 10 blocks), so a pool of 12 blocks serves it under guaranteed_no_evict."""
    window = WINDOW + sinks
    scheduler = windowed_scheduler(12, window, sinks, max_num_tokens=40)
    request = make_request("long", list(range(3, 203)), max_tokens=30)
    assert scheduler.kv.blocks_needed(230) == 29
    assert scheduler.kv.max_blocks_held(230) == 9 + (sinks > 0)
    peak = simulate(scheduler, [request], window, sinks)
    assert peak["long"] == 8 + (sinks > 0)  # the bound above, less one block of alignment
    assert scheduler.kv.stats().allocated_new_blocks == 29  # each block once, then returned
    with pytest.raises(ValueError, match="needs 29 KV cache blocks"):  # without the window
        Scheduler(EngineConfig(max_num_tokens=40), 12, BLOCK).add(make_request("x", [1] * 200, 30))


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_windowed_requests_share_a_small_pool(policy):
    """Several long requests, chunked, in a pool far smaller than their full length; with
    max_utilization a short pool also preempts (recompute frees and reallocates windows)."""
    scheduler = windowed_scheduler(
        24, WINDOW, max_num_tokens=32, max_batch_size=4, batch_scheduler_policy=policy
    )
    rng = random.Random(1)
    requests = [
        make_request(f"r{i}", [rng.randrange(3, 99) for _ in range(rng.randint(60, 150))], 20)
        for i in range(6)
    ]
    peak = simulate(scheduler, requests, WINDOW, 0)
    assert max(peak.values()) <= scheduler.kv.max_blocks_held(170)


def test_prefix_reuse_longer_than_the_window_takes_only_window_blocks():
    """A request reusing a cached prefix of 12 blocks (96 tokens, 4 windows) takes only the
    blocks its window reads; the chain of hashes still decides what matches, and every key it
    reads holds its own prefix's content (checked by the fake model)."""
    scheduler = windowed_scheduler(64, WINDOW, max_num_tokens=64)
    prefix = list(range(10, 106))
    first = make_request("first", prefix + [7, 8, 9], max_tokens=3)
    slots = {}  # the cache's content across the requests
    simulate(scheduler, [first], WINDOW, 0, slots)
    second = make_request("second", prefix + [1, 2, 3, 4, 5], max_tokens=4)
    match = scheduler.kv.match_prefix(second)
    assert match.num_blocks == 12
    kept = scheduler.kv.kept_prefix_blocks(match)
    assert len(kept) == 3  # blocks 9..11: positions 72..95 hold the window of position 96
    simulate(scheduler, [second], WINDOW, 0, slots)
    assert second.num_cached_prompt_tokens == 96 and second.num_reused_blocks == 12
    other = make_request("other", prefix[:50] + [1] * 60, max_tokens=4)  # a shorter shared head
    simulate(scheduler, [other], WINDOW, 0, slots)
    assert other.num_cached_prompt_tokens == 48


def test_mistral_window_prefix_reuse_past_the_window_is_exact(mistral):
    """Requests reusing a cached prefix 4 windows long (and one sharing only its head) match
    transformers; every block is back in the pool at the end."""
    hf, path = mistral
    rng = random.Random(8)
    prefix = [rng.randrange(3, 640) for _ in range(100)]
    prompts = [prefix + [rng.randrange(3, 640) for _ in range(n)] for n in (3, 9, 17)]
    prompts.append(prefix[:40] + [rng.randrange(3, 640) for _ in range(30)])
    executor = Executor(
        EngineConfig(model_path=str(path), device="cpu", tokens_per_block=BLOCK, max_num_tokens=40)
    )
    try:
        params = SamplingParams(max_tokens=12, ignore_end_id=True, return_log_probs=True)
        results = executor.generate(prompts[:1], params) + executor.generate(prompts[1:], params)
        stats = executor.stats().kv
    finally:
        executor.shutdown()
    for prompt, result in zip(prompts, results):
        tokens, logprobs = hf_greedy(hf, prompt, 12)
        assert result["token_ids"] == tokens
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    assert stats.reused_blocks >= 2 * 12 + 5
    assert stats.free_blocks == stats.max_blocks


# ---- attention sinks ------------------------------------------------------------------------


def sink_mask(length: int, window: int, sinks: int) -> torch.Tensor:
    """[1, 1, length, length] additive mask: query q sees key k <= q among the first `sinks`
    tokens and the last window - sinks ones (positions unchanged)."""
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    visible = (k <= q) & ((q - k < window - sinks) | (k < sinks))
    return torch.where(visible, 0.0, float("-inf"))[None, None]


@torch.inference_mode()
def sink_reference_greedy(hf, prompt: list[int], max_tokens: int, window: int, sinks: int):
    """Greedy decoding with transformers, every step a full forward under `sink_mask`."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(max_tokens):
        mask = sink_mask(len(ids), window, sinks)
        logits = hf(input_ids=torch.tensor([ids]), attention_mask=mask).logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        ids.append(token)
    return tokens, logprobs


def test_sinks_match_a_reference_keeping_first_and_last_tokens(tmp_path):
    """sink_token_length 4 with a window of 20 on a Llama: each step's log-probs equal a
    transformers forward that sees only the first 4 and the last 16 tokens; generating 80
    tokens after a prompt of 30 to 40 runs in a cache of 12 blocks (96 tokens), which could not
    hold the sequence without the window."""
    window, sinks = 20, 4
    hf = save_tiny_hf_model(tmp_path, "llama", attn_implementation="eager")
    prompts = random_prompts(2, 640, seed=11, low=30, high=40)
    config = dict(
        model_path=str(tmp_path),
        device="cpu",
        tokens_per_block=BLOCK,
        max_num_tokens=16,
        max_tokens_in_paged_kv_cache=12 * BLOCK,
    )
    params = SamplingParams(max_tokens=80, ignore_end_id=True, return_log_probs=True)
    executor = Executor(
        EngineConfig(**config, max_attention_window_size=str(window), sink_token_length=sinks)
    )
    try:
        results = executor.generate(prompts, params)
        stats = executor.stats().kv
    finally:
        executor.shutdown()
    assert stats.free_blocks == stats.max_blocks
    for prompt, result in zip(prompts, results):
        tokens, logprobs = sink_reference_greedy(hf, prompt, 80, window, sinks)
        assert result["token_ids"] == tokens
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    plain = Executor(EngineConfig(**config))
    try:
        with pytest.raises(ValueError, match="KV cache blocks"):
            plain.generate(prompts[:1], params)
    finally:
        plain.shutdown()


def test_qwen2_per_layer_windows_match_transformers(tmp_path):
    """Qwen2 with use_sliding_window and max_window_layers 1: layer 0 global, layer 1 windowed
    (transformers' layer_types); two KV cache groups, the global one keeping every block."""
    hf = save_tiny_hf_model(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    prompts = random_prompts(4, 640, seed=9, low=3 * WINDOW + 1, high=100)
    results, executor = serve(tmp_path, prompts, 12, max_num_tokens=40)
    assert executor.runner.model_config.layer_windows == [None, WINDOW]
    assert [group.window for group in executor.scheduler.kv.groups] == [None, WINDOW]
    for prompt, result in zip(prompts, results):
        tokens, logprobs = hf_greedy(hf, prompt, 12)
        assert result["token_ids"] == tokens
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    full, _ = serve(tmp_path, prompts, 12, max_num_tokens=40, max_attention_window_size="4096")
    assert [r["token_ids"] for r in full] != [r["token_ids"] for r in results]


def test_model_config_windows_and_engine_overrides():
    base = {
        "model_type": "mistral",
        "vocab_size": 10,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "intermediate_size": 8,
        "sliding_window": 32,
    }
    config = ModelConfig.from_dict(base)
    assert config.layer_windows == [32, 32, 32] and config.attention_window == 32
    assert ModelConfig.from_dict({**base, "sliding_window": None}).layer_windows == [None] * 3
    pattern = config.with_attention_windows((16, 64), sink_token_length=4)
    assert pattern.layer_windows == [16, 64, 16] and pattern.attention_window == 60
    assert config.with_attention_windows(None).layer_windows == [32, 32, 32]
    with pytest.raises(ValueError, match="sink_token_length must be less than the attention"):
        config.with_attention_windows((8,), sink_token_length=8)
    assert EngineConfig(max_attention_window_size="4096,512").attention_windows() == (4096, 512)
    for bad in ("0", "4096,", "a", "-5"):
        with pytest.raises(ValueError, match="max_attention_window_size must be positive"):
            EngineConfig(max_attention_window_size=bad)

"""KV cache groups: a model mixing global and windowed layers (Gemma 2/3) keeps a pool and a
block table per group; the windowed group's blocks wholly outside the window go back to its pool
while the global group keeps every block.

Scheduler-level (a fake model checks every key a chunk reads, in each group's table): block
counts, prefix reuse and preemption. Engine-level: a tiny Gemma 3 (five local layers, one global)
equals transformers token for token, batched, chunked, with prefix reuse and with preemption;
the real gemma-3-270m over a 1,500-token prompt frees its local layers' blocks past the window.
"""

from __future__ import annotations

import random
import threading
from itertools import chain

import pytest

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.engine.output_processor import OutputProcessor
from backend.engine.step import Engine
from backend.model_config import LayerGroup, ModelConfig
from backend.request import Request
from backend.runner.model_runner import ModelRunner
from backend.sampling.sampler import Sampler
from backend.sampling_params import SamplingParams
from backend.scheduling.kv_cache_group import FREED
from backend.scheduling.scheduler import Scheduler
from tests.hf_reference import assert_hf_greedy, hf_greedy
from tests.tiny_models import random_prompts, save_tiny_hf_model

WINDOW = 24
BLOCK = 8
GREEDY = SamplingParams(max_tokens=10, ignore_end_id=True, return_log_probs=True)


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_end_id=True))


def grouped_scheduler(global_blocks: int, window_blocks: int, **config) -> Scheduler:
    return Scheduler(EngineConfig(**config), [global_blocks, window_blocks], BLOCK, [None, WINDOW])


def fake_token(request: Request) -> int:
    return (sum(request.all_ids) * 7 + len(request.all_ids)) % 11


def simulate(scheduler: Scheduler, requests: list[Request], slots=None) -> list[dict]:
    """Run the requests to the end with a fake model that records, per group and cache slot,
    the prefix that produced it, and checks each key a chunk reads in each group (all of them
    globally, the last WINDOW in the window group). Returns each group's peak of held blocks
    per request."""
    kv, slots = scheduler.kv, {} if slots is None else slots
    peaks = [{} for _ in kv.groups]
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work():
        out = scheduler.schedule()
        for chunk in out.chunks:
            request, end = chunk.request, chunk.start + chunk.num_tokens
            tokens = request.all_ids
            tables = kv.tables(request)
            assert len({len(table) for table in tables}) == 1
            for g, (group, table) in enumerate(zip(kv.groups, tables)):
                for pos in range(chunk.start, end):
                    block = table[pos // BLOCK]
                    assert block != FREED and group.pool.ref_count(block) == 1
                    slots[(g, block, pos % BLOCK)] = tuple(tokens[: pos + 1])
                first = 0 if group.window is None else max(0, chunk.start - WINDOW + 1)
                for pos in range(first, end):
                    block = table[pos // BLOCK]
                    assert block != FREED, f"group {g} reads position {pos}, its block was freed"
                    assert slots[(g, block, pos % BLOCK)] == tuple(tokens[: pos + 1])
                live = kv.num_live_blocks(request, g)
                assert live == len([b for b in table if b != FREED])
                peaks[g][request.request_id] = max(peaks[g].get(request.request_id, 0), live)
        scheduler.complete_step(out)
        for chunk in out.chunks:
            if chunk.samples:
                request = chunk.request
                request.output_ids.append(fake_token(request))
                if len(request.output_ids) >= request.sampling.max_tokens:
                    scheduler.finish(request)
    for group in kv.groups:  # every block came back to its own pool
        assert group.pool.num_free == group.pool.num_blocks
    return peaks


def test_model_config_groups_global_and_windowed_layers():
    base = {
        "model_type": "gemma3_text",
        "vocab_size": 10,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "intermediate_size": 8,
        "sliding_window": 32,
    }
    mixed = ModelConfig.from_dict(base).with_attention_windows(None, sink_token_length=4)
    assert mixed.layer_windows == [32] * 5 + [None]
    assert mixed.kv_cache_groups == [LayerGroup(None, (5,)), LayerGroup(28, (0, 1, 2, 3, 4))]
    assert [mixed.kv_cache_group_of(i) for i in range(6)] == [1] * 5 + [0]
    windowed = ModelConfig.from_dict(base).with_attention_windows((16, 64))
    assert windowed.kv_cache_groups == [LayerGroup(64, tuple(range(6)))]  # as before: one group
    plain = ModelConfig.from_dict({**base, "model_type": "llama", "sliding_window": None})
    assert plain.kv_cache_groups == [LayerGroup(None, tuple(range(6)))]


def test_window_group_frees_past_the_window_while_the_global_group_keeps_all():
    """A 200-token prompt + 30 tokens (29 blocks of 8) in chunks of 40: the global group holds
    all 29 blocks at the end, the window group never more than the window before a chunk plus
    the chunk (9 blocks), so a window pool of 10 blocks serves it under guaranteed_no_evict."""
    scheduler = grouped_scheduler(29, 10, max_num_tokens=40)
    request = make_request("long", list(range(3, 203)), max_tokens=30)
    assert scheduler.kv.max_blocks_held(230, group=1) == 9
    peaks = simulate(scheduler, [request])
    assert peaks[0]["long"] == 29 and peaks[1]["long"] <= 9
    assert scheduler.kv.stats().max_blocks == 39  # both pools counted
    with pytest.raises(ValueError, match="needs 29 KV cache blocks but the cache holds 28"):
        grouped_scheduler(28, 40, max_num_tokens=40).add(make_request("x", [1] * 200, 30))
    with pytest.raises(ValueError, match="needs 9 KV cache blocks but the cache holds 8"):
        grouped_scheduler(40, 8, max_num_tokens=40).add(make_request("x", [1] * 200, 30))


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_groups_share_small_pools_with_prefix_reuse_and_preemption(policy):
    """Requests sharing a 64-token prefix, several windows long, chunked; with max_utilization
    the pools are short and running requests are preempted (recompute frees both groups)."""
    small = policy == "max_utilization"
    scheduler = grouped_scheduler(
        40 if small else 120,
        16 if small else 60,
        max_num_tokens=32,
        max_batch_size=4,
        batch_scheduler_policy=policy,
    )
    rng = random.Random(2)
    prefix = [rng.randrange(3, 99) for _ in range(64)]
    first = make_request("first", prefix + [5], max_tokens=4)
    slots = {}
    simulate(scheduler, [first], slots)
    requests = [
        make_request(
            f"r{i}", prefix + [rng.randrange(3, 99) for _ in range(rng.randint(5, 90))], 20
        )
        for i in range(6)
    ]
    peaks = simulate(scheduler, requests, slots)
    assert max(peaks[1].values()) <= scheduler.kv.max_blocks_held(170, group=1)
    assert requests[0].num_cached_prompt_tokens == 64
    if small:
        assert sum(r.num_preemptions for r in requests) > 0


def test_prefix_match_needs_the_window_groups_blocks_too():
    """A cached prefix matches only while the window group still holds the blocks the new
    request's window reads; once another request has taken every block of the window pool, the
    global group's chain alone does not match."""
    scheduler = grouped_scheduler(64, 16, max_num_tokens=64)
    prefix = list(range(10, 106))  # 12 blocks
    slots = {}
    simulate(scheduler, [make_request("first", prefix + [7, 8, 9], 3)], slots)
    second = make_request("second", prefix + [1, 2, 3, 4, 5], 4)
    match = scheduler.kv.match_prefix(second)
    assert match.num_blocks == 12
    assert len(scheduler.kv.kept_prefix_blocks(match, group=0)) == 12
    assert len(scheduler.kv.kept_prefix_blocks(match, group=1)) == 3  # blocks 9..11
    window_pool = scheduler.kv.groups[1].pool
    taken = [window_pool.allocate() for _ in range(window_pool.num_blocks)]  # evicts them all
    for block in taken:
        window_pool.release(block)
    assert scheduler.kv.match_prefix(second).num_blocks == 0
    simulate(scheduler, [second], slots)
    assert second.num_cached_prompt_tokens == 0


# ---- engine: a tiny Gemma 3, five local layers to one global --------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-groups")
    hf = save_tiny_hf_model(path, "gemma3_text", sliding_window=WINDOW)
    return hf, path


def serve(path, prompt_batches, **config):
    executor = Executor(
        EngineConfig(
            model_path=str(path), device="cpu", tokens_per_block=BLOCK, max_num_tokens=32, **config
        )
    )
    try:
        results = [executor.generate(batch, GREEDY, timeout=600) for batch in prompt_batches]
        runner = executor.runner
        pools = [runner.kv_group_blocks, [layer.shape[1] for layer in runner.kv_cache]]
        return list(chain.from_iterable(results)), executor.stats(), runner.model_config, pools
    finally:
        executor.shutdown()


def test_tiny_gemma3_groups_match_transformers_chunked_reused_and_preempted(gemma3):
    hf, path = gemma3
    prefix = random_prompts(1, 640, seed=30, low=40, high=40)[0]  # 5 blocks, past the window
    tails = random_prompts(5, 640, seed=31, low=20, high=70)
    prompts = [prefix + tail for tail in tails]
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    results, stats, model_config, pools = serve(path, [prompts[:1], prompts[1:]], max_batch_size=4)
    assert model_config.kv_cache_groups[1].window == WINDOW
    (global_blocks, window_blocks), layer_blocks = pools
    assert window_blocks < global_blocks  # the window group's share is smaller
    assert layer_blocks == [window_blocks] * 5 + [global_blocks]  # each layer, its group's
    assert stats.kv.reused_blocks >= 5 * 4  # the prefix, cached by the first request
    assert stats.kv.free_blocks == stats.kv.max_blocks == global_blocks + window_blocks
    # 140 tokens' memory (30 + 15 blocks) for four requests of up to 120 tokens: preemption.
    short, short_stats, _, short_pools = serve(
        path,
        [prompts],
        max_batch_size=4,
        batch_scheduler_policy="max_utilization",
        max_tokens_in_paged_kv_cache=140,
        max_seq_len=128,
    )
    # The memory of 18 blocks of all six layers, shared: proportionally to the layers times the
    # blocks a 128-token request holds in each group (16 globally, 8 in the window group).
    assert short_pools[0] == [30, 15] and 30 * 1 + 15 * 5 <= 18 * 6
    assert short_stats.num_preemptions > 0
    assert short_stats.kv.free_blocks == short_stats.kv.max_blocks
    for (tokens, logprobs), result, again in zip(expected, results, short):
        assert result["token_ids"] == again["token_ids"] == tokens
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)


# ---- gemma-3-270m from PyPI: 18 layers, 15 local (window 512) and 3 global -------------------


def serve_step_by_step(runner: ModelRunner, request: Request, on_step) -> None:
    """Drive `Engine.step` by hand, calling on_step(scheduler) after each step."""
    model_config = runner.model_config
    scheduler = Scheduler(
        runner.config,
        runner.kv_group_blocks,
        runner.tokens_per_block,
        [group.window for group in model_config.kv_cache_groups],
    )
    outputs = OutputProcessor(
        runner.max_seq_len, runner.eos_token_ids, lambda r, reason, error: scheduler.finish(r)
    )
    engine = Engine(
        runner,
        Sampler(runner.vocab_size, runner.eos_token_ids),
        scheduler,
        outputs,
        threading.Lock(),
        False,
    )
    scheduler.add(request)
    outputs.add(request, lambda out: None)
    while scheduler.has_work():
        engine.step()
        on_step(scheduler)


@pytest.mark.slow
def test_gemma3_270m_long_prompt_frees_local_layer_blocks_and_matches_transformers(gemma3_270m):
    """A ~1,500-token prompt + 256 greedy tokens in chunks of 256: transformers' tokens; the
    local layers' group holds at most the window before a chunk plus the chunk, the global
    group every block of the sequence; every block back in its pool at the end."""
    gguf_path, tokenizer, model = gemma3_270m
    text = " ".join(
        f"Entry {i}: the {c} {a} crossed the {p} at dawn."
        for i, (c, a, p) in enumerate(
            (c, a, p)
            for c in ("red", "green", "blue", "grey", "white", "black")
            for a in ("fox", "heron", "wolf", "otter", "crow", "lynx", "hare")
            for p in ("river", "bridge", "meadow", "ridge")
        )
    )
    prompt = tokenizer.encode(text)[:1500]
    assert len(prompt) == 1500
    chunk = 256
    config = EngineConfig(
        model_path=gguf_path,
        device="cpu",
        max_batch_size=1,
        max_num_tokens=chunk,
        max_seq_len=2048,
        tokens_per_block=16,
    )
    runner = ModelRunner(config)
    window = 512
    assert [g.window for g in runner.model_config.kv_cache_groups] == [None, window]
    bound = -(-(window + chunk) // 16) + 1
    request = Request("long", prompt, SamplingParams(max_tokens=256, ignore_end_id=True))
    held = []

    def record(scheduler):
        if not request.is_finished:
            held.append(
                (request.num_computed_tokens, *map(len, scheduler.kv.tables(request)))
                + tuple(scheduler.kv.num_live_blocks(request, g) for g in (0, 1))
            )
        else:
            for group in scheduler.kv.groups:
                assert group.pool.num_free == group.pool.num_blocks

    try:
        serve_step_by_step(runner, request, record)
    finally:
        runner.release()
    assert len(request.output_ids) == 256
    assert_hf_greedy(model, prompt, request.output_ids, 256, [])
    # (computed tokens, table lengths, blocks held in the global and the local group) per step
    prefilled = next(h for h in held if h[0] >= len(prompt))
    assert prefilled[3] == prefilled[1] == -(-len(prompt) // 16)  # global: every block
    assert prefilled[4] <= bound and max(h[4] for h in held) <= bound
    assert held[-1][3] == held[-1][1] >= -(-(len(prompt) + 250) // 16)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_tiny_gemma3_groups_over_a_quantized_cache(gemma3, kv_cache_dtype):
    """Both groups store quantized values with their scales: a real continuation (log-probs
    close to the unquantized cache's on the same tokens), every block back in both pools."""
    _, path = gemma3
    prompts = random_prompts(3, 640, seed=32, low=40, high=70)
    plain, _, _, _ = serve(path, [prompts], max_batch_size=4)
    results, stats, _, pools = serve(
        path, [prompts], max_batch_size=4, kv_cache_dtype=kv_cache_dtype
    )
    assert stats.kv.free_blocks == stats.kv.max_blocks == sum(pools[0])
    first = [r["logprobs"][0] for r in results]
    assert first == pytest.approx([r["logprobs"][0] for r in plain], abs=0.05)
    assert sum(a["token_ids"][0] == b["token_ids"][0] for a, b in zip(results, plain)) >= 2

"""N-gram speculative decoding through the executor on the default model (SmolLM2-135M, CPU,
fp32): greedy output equals the unspeculated engine's token for token, with drafts accepted and
rejected, beside unspeculated (sampled, log-prob) requests, with chunked prefill, prefix reuse of
blocks filled by accepted drafts, and stops, end ids and max_tokens inside accepted runs; every
KV block back in the pool at the end. One model runner serves every executor here."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from backend import generate
from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.loading.model_paths import resolve_model
from backend.request import FinishReason
from backend.runner.model_runner import ModelRunner
from backend.sampling_params import SamplingParams
from tests.backend.test_executor import Collector

pytestmark = pytest.mark.slow  # loads the default model

TEXTS = [
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,",  # drafts accepted
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Write a haiku about the sea.",  # drafts mostly rejected
]
MAX_TOKENS = 32
BLOCK = 16
KV_TOKENS = 4096  # a small pool: the default one takes seconds to fill with zeros
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_end_id=True)
UNSPECULATED = [  # served in the same batches, one token a step
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, ignore_end_id=True),
    SamplingParams(max_tokens=MAX_TOKENS, return_log_probs=True, ignore_end_id=True),
]


@pytest.fixture(scope="module")
def model():
    model_dir = resolve_model("default")
    config = EngineConfig(
        model_path=str(model_dir), device="cpu", max_tokens_in_paged_kv_cache=KV_TOKENS
    )
    runner = ModelRunner(config)
    yield AutoTokenizer.from_pretrained(model_dir), runner
    runner.release()


def executor(runner, **config) -> Executor:
    engine = EngineConfig(model_path=runner.model_dir, device="cpu", **config)
    return Executor(engine, runner=runner)


def serve(runner, prompts, params, waves=1, **config):
    """(results, stats): `prompts` served `waves` times in turn on one executor."""
    ex = executor(runner, **config)
    try:
        results = [ex.generate(prompts, params, timeout=300) for _ in range(waves)]
        return results, ex.stats()
    finally:
        ex.shutdown()


def token_ids(results) -> list[list[int]]:
    return [r["token_ids"] for r in results]


def assert_all_blocks_free(stats):
    assert stats.kv.free_blocks == stats.kv.max_blocks


@pytest.fixture(scope="module")
def baseline(model):
    """Without speculation: the greedy prompts, then the unspeculated requests' prompts."""
    tokenizer, runner = model
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = [GREEDY] * len(prompts) + UNSPECULATED
    (results,), _ = serve(runner, prompts + prompts[:2], params)
    return prompts, params, token_ids(results), results


def test_greedy_equals_unspeculated_beside_unspeculated_requests(model, baseline):
    _, runner = model
    prompts, params, expected, plain = baseline
    (results,), stats = serve(runner, prompts + prompts[:2], params, speculative_method="ngram")
    assert token_ids(results) == expected
    greedy, others = results[: len(prompts)], results[len(prompts) :]
    assert all(r["accepted_draft_tokens"] > 0 for r in greedy[:3])
    assert sum(r["draft_tokens"] - r["accepted_draft_tokens"] for r in greedy) > 0  # rejections
    assert all(r["draft_tokens"] == 0 for r in others)
    assert others[1]["logprobs"] == pytest.approx(plain[-1]["logprobs"], abs=1e-4)
    assert stats.num_draft_tokens == sum(r["draft_tokens"] for r in results)
    assert stats.num_accepted_draft_tokens == sum(r["accepted_draft_tokens"] for r in results)
    assert_all_blocks_free(stats)


def test_chunked_prefill_and_a_small_budget(model, baseline):
    """Prompts cut into chunks of 8 tokens; decodes share 8 tokens a step, drafts included."""
    _, runner = model
    prompts, _, expected, _ = baseline
    n = len(prompts)
    (results,), stats = serve(
        runner, prompts, GREEDY, speculative_method="ngram", max_num_tokens=8, tokens_per_block=8
    )
    assert token_ids(results) == expected[:n]
    assert stats.num_accepted_draft_tokens > 0
    assert_all_blocks_free(stats)


def test_prefix_reuse_of_blocks_filled_by_accepted_drafts(model, baseline):
    """A second wave's prompts are the first wave's prompts and outputs: the blocks that held
    accepted drafts are found by their hashes, and continuing from them gives the same tokens."""
    _, runner = model
    prompts, _, expected, _ = baseline
    n, kept = len(prompts), 24
    extended = [p + e[:kept] for p, e in zip(prompts, expected)]
    ex = executor(runner, speculative_method="ngram", tokens_per_block=BLOCK)
    try:
        first = ex.generate(prompts, GREEDY, timeout=300)
        reused = ex.stats().kv.reused_blocks
        second = ex.generate(extended, SamplingParams(max_tokens=8, ignore_end_id=True))
        stats = ex.stats()
    finally:
        ex.shutdown()
    assert token_ids(first) == expected[:n]
    assert token_ids(second) == [e[kept : kept + 8] for e in expected[:n]]
    full_blocks = sum((len(p) - 1) // BLOCK for p in extended)
    assert stats.kv.reused_blocks - reused == full_blocks
    assert stats.num_accepted_draft_tokens > 0
    assert_all_blocks_free(stats)


def test_stops_end_ids_and_max_tokens_inside_accepted_runs(model, baseline):
    """The counting prompt accepts every draft: each limit below falls inside a step's run of
    accepted tokens, and the output ends exactly where the unspeculated engine's does; streamed
    outputs carry the run's tokens in order."""
    _, runner = model
    prompts, _, expected, _ = baseline
    prompt, free = prompts[0], expected[0]
    # The token that occurs first latest ends the output there; the stop sequence ends with it.
    end_at = max(p for p in range(len(free)) if free[p] not in free[:p])
    end, stop = free[end_at], free[end_at - 1 : end_at + 1]
    at = next(i for i in range(len(free)) if free[i : i + 2] == stop)
    assert end_at >= 4  # past the first step's token and into the drafts
    cases = [
        (SamplingParams(max_tokens=MAX_TOKENS, end_id=end), FinishReason.END_ID),
        (
            SamplingParams(max_tokens=MAX_TOKENS, ignore_end_id=True, stop_token_ids=[stop]),
            FinishReason.STOP,
        ),
        (SamplingParams(max_tokens=13, ignore_end_id=True), FinishReason.LENGTH),
    ]
    wanted = [free[: free.index(end)], free[:at], free[:13]]
    ex = executor(runner, speculative_method="ngram")
    try:
        collectors = []
        for i, (params, _) in enumerate(cases):
            collectors.append(Collector())
            ex.submit(f"limit-{i}", prompt, params, collectors[-1])
        finals = [c.final for c in collectors]
        stats = ex.stats()
    finally:
        ex.shutdown()
    for collector, final, (_, reason), tokens in zip(collectors, finals, cases, wanted):
        assert final.finish_reason == reason
        assert collector.tokens == tokens and final.num_output_tokens == len(tokens)
        assert final.num_accepted_draft_tokens > 0
        counts = [o.num_output_tokens for o in collector.outputs]
        assert counts == sorted(counts)
    assert any(len(o.new_token_ids) > 1 for c in collectors for o in c.outputs)
    assert_all_blocks_free(stats)


def test_offline_command_reports_drafts(model, baseline, capsys):
    prompts, _, expected, _ = baseline
    code = generate.main(
        ["--prompt", TEXTS[0], "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"]
        + ["--device", "cpu", "--speculative-method", "ngram"]
        + ["--max-tokens-in-paged-kv-cache", str(KV_TOKENS)]
    )
    assert code == 0
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    assert line["token_ids"] == expected[0]
    assert 0 < line["accepted_draft_tokens"] <= line["draft_tokens"]

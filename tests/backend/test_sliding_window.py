"""Sliding-window attention and attention sinks in the paged cache: a tiny random-weight Mistral
with a window equals transformers token for token (batched, chunked prefill, prefix reuse,
prompts several windows long); blocks wholly outside the window go back to the pool."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.executor import Executor
from backend.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny_models import random_prompts, save_tiny_hf_model

WINDOW = 24
BLOCK = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-window")
    hf = save_tiny_hf_model(path, "mistral", sliding_window=WINDOW)
    return hf, path


def serve(path, prompts, max_tokens, **config) -> tuple[list[dict], Executor]:
    executor = Executor(
        EngineConfig(model_path=str(path), device="cpu", tokens_per_block=BLOCK, **config)
    )
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_end_id=True, return_log_probs=True)
        return executor.generate(prompts, params, timeout=600), executor
    finally:
        executor.shutdown()


def test_mistral_window_matches_transformers_batched_and_chunked(mistral):
    hf, path = mistral
    prompts = random_prompts(6, 640, seed=3, low=5, high=20)  # within the window
    prompts += random_prompts(6, 640, seed=4, low=3 * WINDOW + 1, high=110)  # > 3 windows
    results, executor = serve(path, prompts, 20, max_num_tokens=40, max_batch_size=12)
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

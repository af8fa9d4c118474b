"""Top-k log-probs of generated positions and prompt log-probs equal transformers' log_softmax of
one plain forward over prompt + output, within 1e-4: with chunked prefill, overlap scheduling, a
cached prefix and preemption; requests that ask for nothing get the tokens they got before."""

from __future__ import annotations

import threading

import pytest

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.sampling_params import SamplingParams
from tests.hf_reference import check_logprobs, check_top, hf_greedy, reference_logprobs
from tests.tiny_models import TINY, make_tiny_model, random_prompts

K = 5
ASK = SamplingParams(
    max_tokens=10,
    ignore_end_id=True,
    return_log_probs=True,
    num_top_log_probs=K,
    return_prompt_log_probs=True,
)
PLAIN = SamplingParams(max_tokens=10, ignore_end_id=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, make_tiny_model("llama", path)


def run(model_dir, prompts, params, **config) -> tuple[list[dict], Executor]:
    executor = Executor(EngineConfig(model_path=str(model_dir), device="cpu", **config))
    try:
        return executor.generate(prompts, params, timeout=600), executor
    finally:
        executor.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_mixed_batch(tiny, overlap):
    """Prompts spanning several 16-token chunks, served together with requests that ask for
    nothing (whose tokens equal a run where nobody asks)."""
    path, hf = tiny
    prompts = random_prompts(6, TINY["vocab_size"], seed=3, low=20, high=70)
    params = [ASK if i % 2 == 0 else PLAIN for i in range(len(prompts))]
    config = dict(max_num_tokens=16, tokens_per_block=8, overlap_scheduling=overlap)
    results, executor = run(path, prompts, params, **config)
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        if i % 2 == 0:
            check_logprobs(hf, prompt, result)
        else:
            assert result["top_ids"] == [] and result["prompt_logprobs"] is None
    plain, _ = run(path, prompts, PLAIN, **config)
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in plain]
    stats = executor.stats()
    assert stats.kv.free_blocks == stats.kv.max_blocks


def test_top_k_only_and_different_ks_in_one_batch(tiny):
    """Each request gets its own k (the batch computes the largest); no prompt log-probs unless
    asked; top-k without return_log_probs."""
    path, hf = tiny
    prompts = random_prompts(3, TINY["vocab_size"], seed=5, low=5, high=30)
    params = [
        SamplingParams(max_tokens=6, ignore_end_id=True, num_top_log_probs=k) for k in (1, 3, 20)
    ]
    results, _ = run(path, prompts, params, max_num_tokens=64, tokens_per_block=8)
    for prompt, p, result in zip(prompts, params, results):
        tokens = result["token_ids"]
        ref = reference_logprobs(hf, prompt + tokens)
        assert result["prompt_logprobs"] is None and result["logprobs"] == []
        for j, token in enumerate(tokens):
            check_top(
                result["top_ids"][j],
                result["top_logprobs"][j],
                ref[len(prompt) - 1 + j],
                p.num_top_log_probs,
            )
            assert result["top_ids"][j][0] == token


class Collect:
    """Outputs of requests submitted one by one, with their KV reuse counts."""

    def __init__(self):
        self.results: dict[str, dict] = {}
        self.done = threading.Semaphore(0)

    def __call__(self, rid: str):
        result = self.results[rid] = {
            "token_ids": [],
            "logprobs": [],
            "top_ids": [],
            "top_logprobs": [],
        }

        def on_output(out):
            result["token_ids"] += out.new_token_ids
            result["logprobs"] += out.new_logprobs
            result["top_ids"] += out.new_top_ids or []
            result["top_logprobs"] += out.new_top_logprobs or []
            if out.prompt_logprobs is not None:
                assert "prompt_logprobs" not in result  # the first output only
                result["prompt_logprobs"] = out.prompt_logprobs
                result["prompt_top_ids"] = out.prompt_top_ids
                result["prompt_top_logprobs"] = out.prompt_top_logprobs
            if out.finished:
                result["reused_blocks"] = out.num_reused_blocks
                result["error"] = out.error
                self.done.release()

        return on_output

    def serve(self, executor: Executor, rid: str, prompt: list[int], params: SamplingParams):
        executor.submit(rid, prompt, params, self(rid))
        assert self.done.acquire(timeout=600)
        assert self.results[rid]["error"] is None
        return self.results[rid]


def test_cached_prefix_is_not_reused_for_prompt_logprobs_and_stays_cached(tiny):
    path, hf = tiny
    prefix = random_prompts(1, TINY["vocab_size"], seed=11, low=40, high=40)[0]
    tails = random_prompts(3, TINY["vocab_size"], seed=12, low=5, high=9)
    executor = Executor(
        EngineConfig(model_path=str(path), device="cpu", max_num_tokens=24, tokens_per_block=8)
    )
    try:
        collect = Collect()
        first = collect.serve(executor, "warm", prefix + tails[0], PLAIN)
        assert first["reused_blocks"] == 0
        asking = collect.serve(executor, "ask", prefix + tails[1], ASK)
        assert asking["reused_blocks"] == 0  # the cached prefix was there, and not taken
        check_logprobs(hf, prefix + tails[1], asking)
        after = collect.serve(executor, "after", prefix + tails[2], PLAIN)
        assert after["reused_blocks"] == len(prefix) // 8  # the prefix is still cached
        assert after["token_ids"] == hf_greedy(hf, prefix + tails[2], 10)[0]
        stats = executor.stats()
        assert stats.kv.free_blocks == stats.kv.max_blocks
    finally:
        executor.shutdown()


def test_prompt_logprobs_survive_preemption(tiny):
    """A pool of 40 blocks x 8 tokens holds only a few of these: max_utilization preempts, the
    victims recompute their prompts, and each prompt position is reported once and right."""
    path, hf = tiny
    prompts = random_prompts(8, TINY["vocab_size"], seed=7, low=40, high=110)
    results, executor = run(
        path,
        prompts,
        ASK,
        max_num_tokens=64,
        tokens_per_block=8,
        max_tokens_in_paged_kv_cache=320,
        batch_scheduler_policy="max_utilization",
    )
    for prompt, result in zip(prompts, results):
        check_logprobs(hf, prompt, result)
    stats = executor.stats()
    assert stats.num_preemptions > 0
    assert stats.kv.free_blocks == stats.kv.max_blocks


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(num_top_log_probs=21), "num_top_log_probs must be <= 20, got 21"),
        (dict(num_top_log_probs=-1), "num_top_log_probs must be >= 0, got -1"),
        (dict(num_top_log_probs=2.0), "num_top_log_probs must be an integer"),
        (dict(return_prompt_log_probs=1), "return_prompt_log_probs must be true or false"),
    ],
)
def test_bad_values_are_refused_naming_the_field(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params).validate(512)

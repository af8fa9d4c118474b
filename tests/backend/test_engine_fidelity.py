"""Engine greedy output equals transformers token for token, served concurrently through the
executor, with chunked prefill, prefix reuse and preemption; log-probs of chosen tokens match
within 1e-4."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.loading.model_paths import resolve_model
from backend.sampling_params import SamplingParams
from tests.hf_reference import assert_hf_greedy, hf_greedy, teacher_forced
from tests.tiny_models import TINY, TINY_CONFIGS, make_tiny_model, random_prompts


def serve(
    model_dir, prompts, max_tokens, ignore_end_id=False, logprobs=False, **config
) -> tuple[list[dict], Executor]:
    executor = Executor(EngineConfig(model_path=str(model_dir), device="cpu", **config))
    try:
        params = SamplingParams(
            max_tokens=max_tokens, ignore_end_id=ignore_end_id, return_log_probs=logprobs
        )
        results = executor.generate(prompts, params, timeout=600)
        return results, executor
    finally:
        executor.shutdown()


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_tiny_models_match_transformers(kind, tmp_path):
    hf = make_tiny_model(kind, tmp_path)
    prompts = random_prompts(16, TINY["vocab_size"], seed=len(kind))
    results, _ = serve(
        tmp_path,
        prompts,
        max_tokens=12,
        ignore_end_id=True,
        logprobs=True,
        max_batch_size=16,
        max_num_tokens=256,
        tokens_per_block=8,
    )
    for prompt, result in zip(prompts, results):
        expected, expected_logprobs = hf_greedy(hf, prompt, 12)
        assert result["token_ids"] == expected
        # float32 sums in another order (the steps' batch shapes follow the timing): 1e-4 relative
        assert result["logprobs"] == pytest.approx(expected_logprobs, rel=1e-4, abs=1e-4)


def test_tiny_model_chunked_prefill_and_preemption(tmp_path):
    hf = make_tiny_model("llama", tmp_path)
    prompts = random_prompts(16, TINY["vocab_size"], seed=7, low=20, high=120)
    expected = [hf_greedy(hf, p, 16)[0] for p in prompts]
    chunked, _ = serve(
        tmp_path, prompts, 16, ignore_end_id=True, max_num_tokens=32, tokens_per_block=8
    )
    assert [r["token_ids"] for r in chunked] == expected
    # A pool of 40 blocks x 8 tokens holds ~2-3 of these requests: max_utilization must preempt.
    preempting, executor = serve(
        tmp_path,
        prompts,
        16,
        ignore_end_id=True,
        max_num_tokens=256,
        tokens_per_block=8,
        max_tokens_in_paged_kv_cache=320,
        batch_scheduler_policy="max_utilization",
    )
    assert [r["token_ids"] for r in preempting] == expected
    stats = executor.stats()
    assert stats.num_preemptions > 0
    assert stats.kv.free_blocks == stats.kv.max_blocks


# ---- the default model: SmolLM2-135M-Instruct -------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colours:",
    "Once upon a time, in a small village,",
    "Explain gravity to a child.",
    "The quick brown fox",
    "What is 12 times 12?",
]
SYSTEM = (
    "You are a meticulous assistant for a shipping company. Answer in one short sentence, "
    "never invent tracking numbers, and always stay polite even when customers are upset."
)


@pytest.fixture(scope="module")
def smollm():
    model_dir = resolve_model("default")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, tokenizer, model


def chat_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"])


@pytest.mark.slow
def test_default_model_plain_and_chat(smollm):
    model_dir, tokenizer, model = smollm
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [chat_ids(tokenizer, p) for p in PROMPTS]
    results, _ = serve(model_dir, prompts, 32, logprobs=True, max_batch_size=16)
    for prompt, result in zip(prompts, results):
        assert_hf_greedy(model, prompt, result["token_ids"], 32, [tokenizer.eos_token_id])
        _, logprobs = teacher_forced(model, prompt, result["token_ids"])
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.slow
def test_default_model_chunked_prefix_reuse_and_preemption(smollm):
    model_dir, tokenizer, model = smollm
    prompts = [chat_ids(tokenizer, p, SYSTEM) for p in PROMPTS]
    chunked, _ = serve(model_dir, prompts, 32, max_num_tokens=24, enable_kv_cache_reuse=False)
    expected = [r["token_ids"] for r in chunked]
    for prompt, tokens in zip(prompts, expected):
        assert_hf_greedy(model, prompt, tokens, 32, [tokenizer.eos_token_id])

    # Serve one request first so that its system-prompt blocks are cached, then the rest.
    executor = Executor(EngineConfig(model_path=str(model_dir), device="cpu", tokens_per_block=16))
    try:
        first = executor.generate(prompts[:1], SamplingParams(max_tokens=32))
        rest = executor.generate(prompts[1:], SamplingParams(max_tokens=32))
        assert [r["token_ids"] for r in first + rest] == expected
        assert executor.stats().kv.reused_blocks >= 2 * (len(prompts) - 1)
    finally:
        executor.shutdown()

    preempting, executor = serve(
        model_dir,
        prompts,
        32,
        tokens_per_block=16,
        max_tokens_in_paged_kv_cache=512,
        batch_scheduler_policy="max_utilization",
    )
    assert [r["token_ids"] for r in preempting] == expected
    assert executor.stats().num_preemptions > 0

"""Every model family beyond Llama serves greedy output equal to transformers token for token:
tiny random-weight Qwen3, Phi-3, Gemma 1, 2 and 3 (tests/tiny_models.family_config), batched with
chunked prefill and prefix reuse, chosen-token, top-k and prompt log-probs within 1e-4; and the
real gemma-3-270m (Q4_K_M GGUF from PyPI) against transformers loading the same GGUF.

Gemma 2/3 have sliding windows on some layers (tiny: 128 tokens, gemma-3-270m: 512): the batched
test keeps within them, and a second test runs prompts over three windows long against
transformers' own windowed attention.
"""

from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.model_config import ModelConfig
from backend.sampling_params import SamplingParams
from tests.hf_reference import assert_hf_greedy, check_logprobs, hf_greedy
from tests.tiny_models import FAMILY_KINDS, GEMMA_WINDOW, TINY, make_tiny_model, random_prompts

TOKENS = 12
GREEDY = SamplingParams(max_tokens=TOKENS, ignore_end_id=True, return_log_probs=True)
ASK = SamplingParams(
    max_tokens=TOKENS,
    ignore_end_id=True,
    return_log_probs=True,
    num_top_log_probs=5,
    return_prompt_log_probs=True,
)


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_family_serves_transformers_greedy_batched_chunked_and_reused(kind, tmp_path):
    hf = make_tiny_model(kind, tmp_path)
    prefix = random_prompts(1, TINY["vocab_size"], seed=20, low=24, high=24)[0]  # 3 blocks
    tails = random_prompts(10, TINY["vocab_size"], seed=21, low=1, high=60)
    prompts = [prefix + tail for tail in tails]
    assert max(map(len, prompts)) + TOKENS < GEMMA_WINDOW  # the window changes nothing here
    expected = [hf_greedy(hf, p, TOKENS) for p in prompts]
    config = EngineConfig(
        model_path=str(tmp_path), device="cpu", max_num_tokens=32, tokens_per_block=8
    )
    executor = Executor(config)
    try:
        first = executor.generate(prompts[:1], GREEDY, timeout=600)
        rest = executor.generate(prompts[1:-1], GREEDY, timeout=600)  # chunks of 32 tokens
        asking = executor.generate(prompts[-1:], ASK, timeout=600)
        stats = executor.stats()
    finally:
        executor.shutdown()
    for (tokens, logprobs), result in zip(expected, first + rest):
        assert result["token_ids"] == tokens
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    check_logprobs(hf, prompts[-1], asking[0])
    assert stats.kv.reused_blocks >= 3 * (len(prompts) - 2)  # the prefix, cached by the first


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_local_and_global_layers_past_three_windows_match_transformers(kind, tmp_path):
    """Local layers see the last window, global ones everything: prompts over 3x the window,
    batched, in chunks of 32 tokens."""
    hf = make_tiny_model(kind, tmp_path)
    prompts = random_prompts(3, TINY["vocab_size"], seed=22, low=3 * GEMMA_WINDOW + 10, high=420)
    expected = [hf_greedy(hf, p, TOKENS) for p in prompts]
    config = EngineConfig(
        model_path=str(tmp_path), device="cpu", max_num_tokens=32, tokens_per_block=8
    )
    executor = Executor(config)
    try:
        results = executor.generate(prompts, GREEDY, timeout=600)
        free_after = executor.stats().kv.free_blocks
        max_blocks = executor.stats().kv.max_blocks
    finally:
        executor.shutdown()
    for (tokens, logprobs), result in zip(expected, results):
        assert result["token_ids"] == tokens
        assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    assert free_after == max_blocks


def test_family_configs_record_their_layer_windows(tmp_path):
    """What the window branch reads: per-layer windows in the config and on each attention
    layer (None: global); Gemma 3's five local layers to one global."""
    make_tiny_model("gemma3_text", tmp_path)
    config = ModelConfig.from_dir(str(tmp_path))
    assert config.layer_windows == [GEMMA_WINDOW] * 5 + [None]
    assert config.max_context == config.max_position_embeddings  # windows honoured, not capped
    assert config.rope.theta == 1e6 and config.local_rope.theta == 1e4
    executor = Executor(EngineConfig(model_path=str(tmp_path), device="cpu"))
    try:
        layers = executor.runner.model.model.layers
        assert [layer.self_attn.sliding_window for layer in layers] == config.layer_windows
        assert executor.max_seq_len > GEMMA_WINDOW
    finally:
        executor.shutdown()


def test_unsupported_family_options_are_refused_by_name():
    base = dict(
        model_type="phi3",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**base, "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        ModelConfig.from_dict({**base, "model_type": "gemma2", "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="unsupported model_type 'gemma3'"):
        ModelConfig.from_dict({**base, "model_type": "gemma3"})


# ---- gemma-3-270m from PyPI (Q4_K_M GGUF) ------------------------------------------------------

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


def gemma_chat(text: str) -> str:
    """Gemma's turn format (the base GGUF carries no chat template); the tokenizer adds <bos>."""
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.slow
def test_gemma3_270m_gguf_plain_and_chat_match_transformers(gemma3_270m):
    gguf_path, tokenizer, model = gemma3_270m
    texts = PROMPTS + [gemma_chat(p) for p in PROMPTS]
    prompts = [tokenizer.encode(t) for t in texts]
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)
    assert max(map(len, prompts)) + 32 < 512  # within the sliding window
    config = EngineConfig(model_path=gguf_path, device="cpu", max_batch_size=16)
    executor = Executor(config)
    try:
        assert executor.runner.model_config.model_type == "gemma3_text"
        results = executor.generate(prompts, SamplingParams(max_tokens=32), timeout=1200)
    finally:
        executor.shutdown()
    assert sum(len(r["token_ids"]) for r in results) > 8 * 32  # mostly full-length outputs
    for prompt, result in zip(prompts, results):
        assert_hf_greedy(model, prompt, result["token_ids"], 32, [tokenizer.eos_token_id])


@pytest.mark.slow
def test_gemma3_270m_gguf_blocks_kept_quantized_match_transformers(gemma3_270m):
    """quantization=gguf: the Q4_K / Q5_0 / Q6_K / Q8_0 blocks kept as stored, Gemma's norms read
    back from llama.cpp's 1 + w, the ffn_norm named as the pre-feed-forward norm."""
    gguf_path, tokenizer, model = gemma3_270m
    prompts = [tokenizer.encode(t) for t in (PROMPTS[0], gemma_chat(PROMPTS[1]))]
    config = EngineConfig(model_path=gguf_path, device="cpu", quantization="gguf")
    executor = Executor(config)
    try:
        # each CPU step de-quantizes every block it reads: 8 steps say what 16 would
        results = executor.generate(prompts, SamplingParams(max_tokens=8), timeout=1200)
    finally:
        executor.shutdown()
    for prompt, result in zip(prompts, results):
        assert_hf_greedy(model, prompt, result["token_ids"], 8, [tokenizer.eos_token_id])


def test_configs_without_layer_types_get_transformers_defaults():
    """Configs on the Hub written before `layer_types`: Gemma 2 alternates local and global
    layers, Gemma 3 has one global layer in `sliding_window_pattern`, with the older rotary keys;
    Qwen slides from `max_window_layers` on when `use_sliding_window` is set."""
    base = dict(
        vocab_size=64, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        num_hidden_layers=6, sliding_window=16,
    )  # fmt: skip
    gemma2 = ModelConfig.from_dict({**base, "model_type": "gemma2"})
    assert gemma2.layer_windows == [16, None] * 3
    gemma3 = ModelConfig.from_dict(
        {
            **base,
            "model_type": "gemma3_text",
            "sliding_window_pattern": 3,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    assert gemma3.layer_windows == [16, 16, None] * 2
    assert (gemma3.rope.theta, gemma3.rope.type, gemma3.rope.factor) == (1e6, "linear", 8.0)
    assert (gemma3.local_rope.theta, gemma3.local_rope.type) == (1e4, "default")
    qwen3 = {**base, "model_type": "qwen3", "max_window_layers": 4}
    assert ModelConfig.from_dict(qwen3).layer_windows == [None] * 6
    assert ModelConfig.from_dict({**qwen3, "use_sliding_window": True}).layer_windows == (
        [None] * 4 + [16] * 2
    )

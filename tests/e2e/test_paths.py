"""Every entry point returns the engine's greedy output for the same prompt, token for token.

Reference: the token ids that `tensorrt_llm` returns for the prompt's ids (what
inflight_batcher_llm_client.py does). Text paths must return exactly their decode.
"""

from __future__ import annotations

import pytest

from tests.e2e.clients import generate, generate_stream, grpc_request

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def end_id(tokenizer) -> int:
    from preprocessing.tokenizer import default_end_id

    return default_end_id(tokenizer)


@pytest.fixture(scope="module")
def reference(triton, tokenizer, end_id):
    """(prompt ids, generated ids) from the LLM model directly, not streamed."""
    prompt_ids = tokenizer.encode(PROMPT)
    result = grpc_request(
        triton.grpc,
        "tensorrt_llm",
        {
            "input_ids": prompt_ids,
            "input_lengths": len(prompt_ids),
            "request_output_len": MAX_TOKENS,
            "end_id": end_id,
        },
    )
    assert result.error is None, result.error
    assert len(result.responses) == 1  # not streamed: exactly one response
    ids = result.ids()
    assert 0 < len(ids) <= MAX_TOKENS
    assert int(result.responses[0]["sequence_length"].reshape(-1)[0]) == len(ids)
    return prompt_ids, ids


def test_llm_streaming_ids_concatenate_to_the_non_streamed_ids(triton, reference, end_id):
    prompt_ids, ids = reference
    result = grpc_request(
        triton.grpc,
        "tensorrt_llm",
        {
            "input_ids": prompt_ids,
            "input_lengths": len(prompt_ids),
            "request_output_len": MAX_TOKENS,
            "end_id": end_id,
            "streaming": True,
        },
    )
    assert result.error is None, result.error
    assert len(result.responses) > 1
    assert result.ids() == ids


def test_llm_echoes_the_prompt_when_asked(triton, reference, end_id):
    prompt_ids, ids = reference
    result = grpc_request(
        triton.grpc,
        "tensorrt_llm",
        {
            "input_ids": prompt_ids,
            "input_lengths": len(prompt_ids),
            "end_id": end_id,
            "request_output_len": MAX_TOKENS,
            "exclude_input_in_output": False,
        },
    )
    assert result.ids() == prompt_ids + ids


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate(triton, tokenizer, reference, model):
    _, ids = reference
    response = generate(triton.http, model, {"text_input": PROMPT, "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text_output"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert "batch_index" in body and "sequence_index" in body
    for name in (
        "cum_log_probs",
        "output_log_probs",
        "kv_cache_alloc_new_blocks",
        "arrival_time_ns",
        "last_token_time_ns",
    ):
        assert name not in body, name  # as TensorRT-LLM: only when asked
    timed = generate(
        triton.http,
        model,
        {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "return_perf_metrics": True},
    ).json()
    assert (
        0
        < timed["arrival_time_ns"]
        <= timed["first_scheduled_time_ns"]
        <= timed["first_token_time_ns"]
        <= timed["last_token_time_ns"]
    )


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate_stream(triton, tokenizer, reference, model):
    _, ids = reference
    events = generate_stream(
        triton.http, model, {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    )
    assert len(events) > 1
    assert all("error" not in e for e in events), events
    assert "".join(e["text_output"] for e in events) == tokenizer.decode(
        ids, skip_special_tokens=True
    )


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("stream", [True, False])
def test_grpc_stream(triton, tokenizer, reference, model, stream):
    _, ids = reference
    result = grpc_request(
        triton.grpc, model, {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}
    )
    assert result.error is None, result.error
    assert (len(result.responses) > 1) == stream
    assert result.text() == tokenizer.decode(ids, skip_special_tokens=True)


def test_ensemble_echoes_the_prompt_when_asked(triton, tokenizer, reference):
    prompt_ids, ids = reference
    body = generate(
        triton.http,
        "ensemble",
        {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "exclude_input_in_output": False},
    ).json()
    assert body["text_output"] == tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
    events = generate_stream(
        triton.http,
        "ensemble",
        {
            "text_input": PROMPT,
            "max_tokens": MAX_TOKENS,
            "exclude_input_in_output": False,
            "stream": True,
        },
    )
    assert "".join(e["text_output"] for e in events) == body["text_output"]


def test_log_probs_and_perf_metrics(triton, reference):
    _, ids = reference
    result = grpc_request(
        triton.grpc,
        "ensemble",
        {
            "text_input": PROMPT,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "return_log_probs": True,
            "return_perf_metrics": True,
        },
    )
    assert result.error is None, result.error
    logprobs = [float(x) for r in result.responses for x in r["output_log_probs"].reshape(-1)]
    assert len(logprobs) == len(ids)
    assert all(lp <= 0 for lp in logprobs)
    last = result.responses[-1]
    assert abs(float(last["cum_log_probs"].reshape(-1)[0]) - sum(logprobs)) < 1e-3
    assert int(last["kv_cache_alloc_total_blocks"].reshape(-1)[0]) >= 1

"""Malformed requests get a clear error naming the field; a good request alongside is unaffected."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import requests

from tests.e2e.clients import generate, grpc_request, metric, metrics

pytestmark = pytest.mark.e2e

GOOD = {"text_input": "The three primary colors are", "max_tokens": 24}
IDS = [504, 3575, 282, 4649, 314]  # token ids of "The capital of France is"
LLM = {"input_ids": IDS, "input_lengths": len(IDS), "request_output_len": 4}


def _ens(**changes) -> dict:
    inputs = {"text_input": "Hello there", "max_tokens": 4}
    inputs.update(changes)
    return {k: v for k, v in inputs.items() if v is not None}


# (case, model, inputs, substrings the error must contain)
CASES = [
    (
        "text_input wrong dtype",
        "ensemble",
        {"text_input": np.array([[1]], dtype=np.int32), "max_tokens": 4},
        ["text_input"],
    ),
    (
        "max_tokens wrong dtype",
        "ensemble",
        _ens(max_tokens=np.array([[4.0]], dtype=np.float32)),
        ["max_tokens"],
    ),
    ("top_k wrong shape", "ensemble", _ens(top_k=np.array([[1, 2]], dtype=np.int32)), ["top_k"]),
    ("missing text_input", "ensemble", {"max_tokens": 4}, ["text_input"]),
    ("unknown input", "ensemble", _ens(foo=np.array([[1]], dtype=np.int32)), ["foo"]),
    ("negative max_tokens", "ensemble", _ens(max_tokens=-5), ["max_tokens must be >= 1"]),
    ("zero max_tokens", "ensemble", _ens(max_tokens=0), ["max_tokens must be >= 1"]),
    ("top_p above 1", "ensemble", _ens(top_p=1.5), ["top_p", "(0, 1]", "1.5"]),
    ("negative temperature", "ensemble", _ens(temperature=-1.0), ["temperature must be >= 0"]),
    ("negative top_k", "ensemble", _ens(top_k=-1), ["top_k", ">= 0"]),
    (
        "zero repetition_penalty",
        "ensemble",
        _ens(repetition_penalty=0.0),
        ["repetition_penalty must be > 0"],
    ),
    ("negative min_tokens", "ensemble", _ens(min_tokens=-1), ["min_tokens must be >= 0"]),
    ("prompt over max_seq_len", "ensemble", _ens(text_input="word " * 700), ["max_seq_len"]),
    (
        "invalid UTF-8 text",
        "ensemble",
        _ens(text_input=np.array([[b"caf\xc3 \xff\xfe"]], dtype=np.object_)),
        ["text_input must be valid UTF-8"],
    ),
    ("empty text", "ensemble", _ens(text_input=""), ["text_input must not be empty"]),
    (
        "invalid UTF-8 stop word",
        "ensemble",
        _ens(stop_words=np.array([[b"\xff"]], dtype=np.object_)),
        ["stop_words must be valid UTF-8"],
    ),
    (
        "unclosed quote in stop words",
        "ensemble",
        _ens(stop_words='"never closed,a'),
        ["stop_words", "closing quote"],
    ),
    (
        "20,000 bad words",
        "ensemble",
        _ens(bad_words=",".join(f"w{i}" for i in range(20000))),
        ["bad_words has 20000 words; at most 256"],
    ),
    (
        "a stop word of 5,000 characters",
        "ensemble",
        _ens(stop_words="x" * 5000),
        ["stop_words: a word of 5000 characters; at most 1024"],
    ),
    ("beam search", "ensemble", _ens(beam_width=4), ["beam_width must be 1"]),
    (
        "several sequences",
        "ensemble",
        _ens(num_return_sequences=2),
        ["num_return_sequences must be 1"],
    ),
    (
        "embedding bias length mismatch",
        "ensemble",
        _ens(embedding_bias_words=["red", "blue"], embedding_bias_weights=[1.0]),
        ["embedding_bias_words and embedding_bias_weights", "2 and 1"],
    ),
    (
        "embedding bias weights alone",
        "ensemble",
        _ens(embedding_bias_weights=[1.0]),
        ["embedding_bias_words and embedding_bias_weights must be sent together"],
    ),
    ("end_id outside the vocabulary", "ensemble", _ens(end_id=10**6), ["end_id", "vocab"]),
    (
        "generation logits",
        "ensemble",
        _ens(return_generation_logits=True),
        ["return_generation_logits is not supported"],
    ),
    (
        "stop_words_list offsets decrease",
        "tensorrt_llm",
        {**LLM, "stop_words_list": np.array([[[5, 6, 7], [2, 1, -1]]], dtype=np.int32)},
        ["stop_words_list offsets must be strictly increasing"],
    ),
    (
        "bad_words_list wrong shape",
        "tensorrt_llm",
        {**LLM, "bad_words_list": np.array([[[5], [1], [0]]], dtype=np.int32)},
        ["bad_words_list"],
    ),
    (
        "embedding_bias longer than the vocabulary",
        "tensorrt_llm",
        {**LLM, "embedding_bias": np.zeros((1, 60000), dtype=np.float32)},
        ["embedding_bias must have at most vocab size"],
    ),
    (
        "input_lengths beyond input_ids",
        "tensorrt_llm",
        {**LLM, "input_lengths": 9},
        ["input_lengths must be in [0, 5]"],
    ),
    (
        "token id outside the vocabulary",
        "tensorrt_llm",
        {**LLM, "input_ids": [1, 2, 99999], "input_lengths": 3},
        ["prompt token ids", "49152"],
    ),
    ("stop without a request id", "tensorrt_llm", {"stop": True}, ["stop", "request id"]),
]


@pytest.fixture(scope="module")
def good_text(triton) -> str:
    response = generate(triton.http, "ensemble", GOOD)
    assert response.status_code == 200, response.text
    return response.json()["text_output"]


def test_each_bad_request_gets_an_error_naming_the_field(triton, good_text):
    assert len(CASES) >= 15
    alongside = {}
    good = threading.Thread(
        target=lambda: alongside.update(
            result=grpc_request(triton.grpc, "ensemble", {**GOOD, "stream": True})
        )
    )
    good.start()
    failures = []
    for case, model, inputs, expected in CASES:
        result = grpc_request(triton.grpc, model, inputs, timeout=60)
        if result.error is None or not all(s in result.error for s in expected):
            failures.append(f"{case}: expected {expected} in error, got {result.error!r}")
    good.join(timeout=120)
    assert not failures, "\n".join(failures)
    assert alongside["result"].error is None
    assert alongside["result"].text() == good_text


def test_http_errors_are_client_errors(triton, good_text):
    response = generate(triton.http, "ensemble", {"text_input": "Hi", "max_tokens": -1})
    assert response.status_code == 400
    assert "max_tokens must be >= 1" in response.json()["error"]
    response = generate(triton.http, "ensemble", {"max_tokens": 4})
    assert response.status_code == 400 and "text_input" in response.json()["error"]


def test_server_is_healthy_after_bad_input(triton, good_text):
    assert requests.get(f"http://{triton.http}/v2/health/ready", timeout=10).status_code == 200
    response = generate(triton.http, "ensemble", GOOD)
    assert response.json()["text_output"] == good_text


def test_refusals_in_the_adapter_are_counted_as_invalid(triton, good_text):
    """A prompt over max_seq_len is refused in the LLM model's stub, before the engine: the
    refusal still counts in nv_llm_requests_rejected_total{reason="invalid"}."""

    def invalid() -> float:
        return metric(metrics(triton.metrics), "nv_llm_requests_rejected_total", reason="invalid")

    before = invalid()
    for _ in range(2):
        result = grpc_request(triton.grpc, "ensemble", _ens(text_input="word " * 700))
        assert result.error is not None and "max_seq_len" in result.error
    deadline = time.monotonic() + 20
    while invalid() < before + 2:
        assert time.monotonic() < deadline, f"invalid refusals stayed at {invalid()}"
        time.sleep(0.2)

"""32 concurrent streaming requests with mixed parameters through the ensemble.

- every streamed text (deltas concatenated) equals the same request's non-streamed text,
  including answers with multi-byte characters (Japanese, Chinese, emoji, French accents);
- every greedy request returns the same text as when it is sent alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.clients import generate, grpc_request

pytestmark = pytest.mark.e2e

ENGLISH = [
    "The capital of France is",
    "Once upon a time, there was a",
    "The best way to learn is",
    "Water boils at",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, astronauts",
    "A haiku about autumn:",
    "The sun rises in the",
    "My favourite programming language is",
    "To make tea, first",
    "The largest ocean is the",
]
NON_ASCII = [
    "Translate to Japanese: Good morning, how are you? Japanese:",
    "日本の首都は東京です。日本の首都は",
    "Write three emoji about the sea: 🌊🐠",
    "Le café à côté de l'église est très",
    "Chinese: 你好，世界！Chinese:",
    "Crème brûlée, pâté, déjà vu, naïve, façade,",
]


def _requests() -> list[dict]:
    requests = []
    for i, prompt in enumerate(ENGLISH + NON_ASCII):
        requests.append({"text_input": prompt, "max_tokens": 12 + i % 9})
    for i, prompt in enumerate(ENGLISH[:8]):  # sampled, seeded
        requests.append(
            {
                "text_input": prompt,
                "max_tokens": 16,
                "temperature": 0.8,
                "top_k": 40,
                "top_p": 0.95,
                "seed": 100 + i,
            }
        )
    requests.append({"text_input": ENGLISH[0], "max_tokens": 20, "stop_words": "answer"})
    requests.append({"text_input": ENGLISH[1], "max_tokens": 20, "bad_words": "little,girl"})
    requests.append({"text_input": ENGLISH[2], "max_tokens": 14, "exclude_input_in_output": False})
    requests.append(
        {"text_input": NON_ASCII[1], "max_tokens": 14, "exclude_input_in_output": False}
    )
    requests.append(
        {
            "text_input": ENGLISH[3],
            "max_tokens": 14,
            "repetition_penalty": 1.3,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
        }
    )
    requests.append({"text_input": ENGLISH[4], "max_tokens": 14, "min_tokens": 14, "end_id": 2})
    assert len(requests) == 32
    return requests


def _greedy(request: dict) -> bool:
    return "temperature" not in request


def _stream(triton, request: dict) -> str:
    result = grpc_request(triton.grpc, "ensemble", {**request, "stream": True})
    assert result.error is None, (request, result.error)
    return result.text()


def _whole(triton, request: dict) -> str:
    response = generate(triton.http, "ensemble", request)
    assert response.status_code == 200, (request, response.text)
    return response.json()["text_output"]


def test_concurrent_streams_match_non_streamed_and_alone(triton):
    requests = _requests()
    alone = {i: _whole(triton, r) for i, r in enumerate(requests) if _greedy(r)}
    with ThreadPoolExecutor(len(requests)) as pool:
        streamed = list(pool.map(lambda r: _stream(triton, r), requests))
    with ThreadPoolExecutor(len(requests)) as pool:
        whole = list(pool.map(lambda r: _whole(triton, r), requests))

    for i, request in enumerate(requests):
        assert streamed[i] == whole[i], (request, streamed[i], whole[i])
        if _greedy(request):
            assert whole[i] == alone[i], (request, whole[i], alone[i])
    non_ascii = [t for t in whole if any(ord(c) > 127 for c in t)]
    assert len(non_ascii) >= 4, whole
    echoed = requests.index(
        {"text_input": ENGLISH[2], "max_tokens": 14, "exclude_input_in_output": False}
    )
    assert whole[echoed].startswith(ENGLISH[2])
    stopped = whole[
        requests.index({"text_input": ENGLISH[0], "max_tokens": 20, "stop_words": "answer"})
    ]
    assert "answer" not in stopped


def test_concurrent_token_streams_keep_their_order_under_coalescing(triton, tokenizer):
    """24 streams of 40 tokens each from tensorrt_llm at once: the sender folds a stream's
    waiting outputs into one response when it falls behind and answers finished streams first,
    so each stream's ids, concatenated, must still be its non-streamed ids, with no empty data
    response and the final flag once, at the end."""
    prompts = [tokenizer.encode(p) for p in (ENGLISH + NON_ASCII)[:24]]

    def ask(ids, streaming: bool):
        return grpc_request(
            triton.grpc,
            "tensorrt_llm",
            {
                "input_ids": ids,
                "input_lengths": len(ids),
                "request_output_len": 40,
                "end_id": -1,
                "streaming": streaming,
            },
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        streamed = list(pool.map(lambda ids: ask(ids, True), prompts))
        whole = list(pool.map(lambda ids: ask(ids, False), prompts))
    for stream, one in zip(streamed, whole):
        assert stream.error is None and one.error is None, (stream.error, one.error)
        assert all(r["output_ids"].size > 0 for r in stream.responses)
        assert len(one.responses) == 1 and stream.ids() == one.ids() and len(one.ids()) == 40

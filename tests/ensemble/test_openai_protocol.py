"""OpenAI request bodies (ensemble/openai_server/protocol.py) and errors (errors.py): a bad field
is a 400 naming it, unsupported features are refused by name, and the engine's refusals map to
the statuses OpenAI clients act on."""

from __future__ import annotations

import pytest

from backend.process.client import SHUTTING_DOWN
from backend.scheduling.scheduler import QueueFullError
from ensemble.openai_server.errors import ApiError, from_triton
from ensemble.openai_server.protocol import ChatCompletionRequest, CompletionRequest, parse

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": {"not": "a prompt"}}, "prompt"),
        ({"seed": -1}, "seed"),
        ({"stop": 5}, "stop"),
    ],
)
def test_bad_completion_fields_are_named(extra, param):
    with pytest.raises(ApiError) as error:
        parse(CompletionRequest, {"model": "m", "prompt": "Hi", **extra})
    assert error.value.status == 400 and error.value.param == param
    assert error.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ],
)
def test_bad_chat_fields_are_named(extra, param):
    with pytest.raises(ApiError) as error:
        parse(ChatCompletionRequest, {**CHAT, **extra})
    assert error.value.status == 400 and error.value.param == param


def test_prompt_forms():
    def prompts(prompt):
        return parse(CompletionRequest, {"model": "m", "prompt": prompt}).prompts()

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def test_echo_allows_zero_max_tokens_and_chat_text_parts():
    body = parse(CompletionRequest, {"model": "m", "prompt": "a", "max_tokens": 0, "echo": True})
    assert body.max_tokens == 0
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    chat = parse(ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert chat.messages[0].text() == "Hello, world"


def test_engine_refusals_map_to_openai_statuses():
    full = QueueFullError("request queue is full (max_queue_size=1); retry later")
    queue_full = f"Exceeds maximum queue size: {full}"  # as backend/process/client.py words it
    assert from_triton(queue_full).status == 429
    assert from_triton(SHUTTING_DOWN).status == 503
    assert from_triton("top_p (input runtime_top_p) must be in (0, 1], got 1.5").status == 400
    assert from_triton("internal error: boom").status == 500

"""Chat prompts through the ensemble and BLS (apply_chat_template), and the finish_reason output.

Reference: the token ids that `tensorrt_llm` returns for the same prompt ids, greedy.
"""

from __future__ import annotations

import json

import pytest

from preprocessing.tokenizer import apply_chat_template, default_end_id
from tests.e2e.clients import generate, grpc_request

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"
CHAT_MAX_TOKENS = 48
PROMPT = "The capital of France is"
MAX_TOKENS = 24


def _llm(triton, prompt_ids: list[int], max_tokens: int, **extra):
    result = grpc_request(
        triton.grpc,
        "tensorrt_llm",
        {
            "input_ids": prompt_ids,
            "input_lengths": len(prompt_ids),
            "request_output_len": max_tokens,
            **extra,
        },
    )
    assert result.error is None, result.error
    return result


@pytest.fixture(scope="module")
def chat_reference(triton, tokenizer):
    """Generated ids and finish reason of the LLM on the templated question's ids."""
    result = _llm(
        triton,
        apply_chat_template(tokenizer, QUESTION),
        CHAT_MAX_TOKENS,
        end_id=default_end_id(tokenizer),
    )
    return result.ids(), result.responses[-1]["finish_reason"].reshape(-1)[0].decode()


@pytest.fixture(scope="module")
def reference(triton, tokenizer):
    """Greedy ids of PROMPT, with the end id ignored so that every run has MAX_TOKENS of them."""
    ids = _llm(triton, tokenizer.encode(PROMPT), MAX_TOKENS, end_id=-1).ids()
    assert len(ids) == MAX_TOKENS
    return ids


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_chat_request_answers_what_the_engine_gives_on_the_templated_ids(
    triton, tokenizer, chat_reference, model
):
    ids, reason = chat_reference
    answer = tokenizer.decode(ids, skip_special_tokens=True)
    assert answer.strip()  # the template is what makes it answer at all
    body = generate(
        triton.http,
        model,
        {"text_input": QUESTION, "max_tokens": CHAT_MAX_TOKENS, "apply_chat_template": True},
    )
    assert body.status_code == 200, body.text
    assert body.json()["text_output"] == answer
    assert body.json()["finish_reason"] == reason
    streamed = grpc_request(
        triton.grpc,
        model,
        {
            "text_input": QUESTION,
            "max_tokens": CHAT_MAX_TOKENS,
            "apply_chat_template": True,
            "stream": True,
        },
    )
    assert streamed.error is None, streamed.error
    assert streamed.text() == answer


def test_the_curl_example_printed_by_serve_gets_an_answer(triton, tokenizer, chat_reference):
    command = triton.server.curl_example()
    assert f"localhost:{triton.settings.http_port}/v2/models/ensemble/generate" in command
    body = json.loads(command.split(" -d '", 1)[1].rstrip("'"))
    answer = generate(triton.http, "ensemble", body).json()["text_output"]
    assert answer and answer == tokenizer.decode(
        chat_reference[0][: body["max_tokens"]], skip_special_tokens=True
    )


def test_the_client_example_asks_an_instruct_model_in_its_chat_template(
    triton, tokenizer, chat_reference, capsys
):
    from benchmarks import client_example

    args = ["--url", triton.grpc, "--prompt", QUESTION, "--max-tokens", str(CHAT_MAX_TOKENS)]
    assert client_example.main(args) == 0
    assert (
        capsys.readouterr().out
        == tokenizer.decode(chat_reference[0], skip_special_tokens=True) + "\n"
    )


def test_the_repository_default_is_plain_text(triton, tokenizer, reference):
    for flag in ({}, {"apply_chat_template": False}):
        body = generate(
            triton.http,
            "ensemble",
            {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "end_id": -1, **flag},
        ).json()
        assert body["text_output"] == tokenizer.decode(reference, skip_special_tokens=True)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_finish_reason_of_each_way_to_end(triton, tokenizer, reference, model):
    def reason(**inputs) -> str:
        body = generate(triton.http, model, {"text_input": PROMPT, **inputs})
        assert body.status_code == 200, body.text
        return body.json()["finish_reason"]

    assert reason(max_tokens=4, end_id=-1) == "length"
    # the end id: a token greedy decoding reaches after a few others
    k = next(i for i in range(3, MAX_TOKENS) if reference[i] not in reference[:i])
    assert reason(max_tokens=MAX_TOKENS, end_id=reference[k]) == "end_id"
    # a stop word: the text of a generated token that encodes back to that token
    stop = next(
        tokenizer.decode([t])
        for i, t in enumerate(reference)
        if i >= 2
        and t not in reference[:i]
        and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    assert reason(max_tokens=MAX_TOKENS, end_id=-1, stop_words=[stop]) == "stop"


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls", "tensorrt_llm"])
def test_finish_reason_is_empty_until_the_last_streamed_response(triton, tokenizer, model):
    if model == "tensorrt_llm":
        ids = tokenizer.encode(PROMPT)
        inputs = {
            "input_ids": ids,
            "input_lengths": len(ids),
            "request_output_len": 6,
            "end_id": -1,
            "streaming": True,
        }
    else:
        inputs = {"text_input": PROMPT, "max_tokens": 6, "end_id": -1, "stream": True}
    result = grpc_request(triton.grpc, model, inputs)
    assert result.error is None, result.error
    reasons = [r["finish_reason"].reshape(-1)[0] for r in result.responses]
    assert len(reasons) > 1
    assert reasons[:-1] == [b""] * (len(reasons) - 1) and reasons[-1] == b"length"

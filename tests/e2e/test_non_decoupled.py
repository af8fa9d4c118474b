"""decoupled_mode=false: plain `infer()` over HTTP and gRPC gets one response holding the whole
answer, the same greedy tokens and text as the decoupled server's streamed path.

One extra server for the module (the session's decoupled server is the reference). It also
applies the chat template by default (apply_chat_template=true), so the text requests here send
apply_chat_template=false, the per-request override.
"""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.e2e.clients import generate, generate_stream, grpc_request, infer
from tests.e2e.conftest import running_triton

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MAX_TOKENS = 24
PLAIN = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "apply_chat_template": False}
PROTOCOLS = ["http", "grpc"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A server whose tensorrt_llm and tensorrt_llm_bls are not decoupled (nor is the ensemble)."""
    with running_triton(
        tmp_path_factory.mktemp("triton-not-decoupled"),
        decoupled_mode=False,
        apply_chat_template=True,
    ) as server:
        yield server


def _url(server, protocol: str) -> str:
    return server.http if protocol == "http" else server.grpc


@pytest.fixture(scope="module")
def streamed(triton, tokenizer):
    """(prompt ids, generated ids, text) streamed by the decoupled server's LLM model."""
    prompt_ids = tokenizer.encode(PROMPT)
    result = grpc_request(
        triton.grpc,
        "tensorrt_llm",
        {
            "input_ids": prompt_ids,
            "input_lengths": len(prompt_ids),
            "request_output_len": MAX_TOKENS,
            "streaming": True,
        },
    )
    assert result.error is None, result.error
    assert len(result.responses) > 1
    ids = result.ids()
    return prompt_ids, ids, tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_llm_infer_returns_every_token_in_one_response(plain, streamed, protocol):
    prompt_ids, ids, _ = streamed
    out = infer(
        protocol,
        _url(plain, protocol),
        "tensorrt_llm",
        {
            "input_ids": prompt_ids,
            "input_lengths": len(prompt_ids),
            "request_output_len": MAX_TOKENS,
        },
    )
    assert out["output_ids"].reshape(-1).tolist() == ids
    assert out["sequence_length"].reshape(-1).tolist() == [len(ids)]
    assert out["finish_reason"].reshape(-1).tolist() == [
        b"length" if len(ids) == MAX_TOKENS else b"end_id"
    ]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_text_infer_equals_the_streamed_text(triton, plain, streamed, model):
    text = streamed[2]
    assert (
        grpc_request(
            triton.grpc, model, {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
        ).text()
        == text
    )
    for protocol in PROTOCOLS:
        out = infer(protocol, _url(plain, protocol), model, PLAIN)
        assert out["text_output"].reshape(-1)[0].decode() == text, protocol
        assert out["finish_reason"].reshape(-1).tolist() == [
            b"length" if len(streamed[1]) == MAX_TOKENS else b"end_id"
        ]


def test_rows_of_one_request_come_back_together(plain, tokenizer):
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("def fib(n):")]
    singles = [
        infer(
            "grpc",
            plain.grpc,
            "tensorrt_llm",
            {"input_ids": p, "input_lengths": len(p), "request_output_len": 8},
        )["output_ids"]
        .reshape(-1)
        .tolist()
        for p in prompts
    ]
    width = max(len(p) for p in prompts)
    ids = np.zeros((2, width), dtype=np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    out = infer(
        "http",
        plain.http,
        "tensorrt_llm",
        {
            "input_ids": ids,
            "input_lengths": np.array([[len(p)] for p in prompts], dtype=np.int32),
            "request_output_len": np.array([[8], [8]], dtype=np.int32),
        },
    )
    lengths = out["sequence_length"].reshape(-1).tolist()
    assert out["batch_index"].reshape(-1).tolist() == [0, 1]
    assert [out["output_ids"][i, 0, :n].tolist() for i, n in enumerate(lengths)] == singles


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_streaming_request_is_refused_alone(plain, streamed, protocol):
    with pytest.raises(InferenceServerException) as err:
        infer(protocol, _url(plain, protocol), "ensemble", {**PLAIN, "stream": True})
    assert "stream (input streaming) must be false" in str(err.value)
    assert "decoupled_mode" in str(err.value)
    out = infer(protocol, _url(plain, protocol), "ensemble", PLAIN)
    assert out["text_output"].reshape(-1)[0].decode() == streamed[2]


def test_generate_and_grpc_stream_give_one_response(plain, streamed):
    text = streamed[2]
    body = generate(plain.http, "ensemble", PLAIN)
    assert body.status_code == 200, body.text
    assert body.json()["text_output"] == text
    events = generate_stream(plain.http, "ensemble", PLAIN)
    assert [e.get("text_output") for e in events] == [text]
    result = grpc_request(plain.grpc, "ensemble", PLAIN)
    assert result.error is None and len(result.responses) == 1
    assert result.text() == text


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_the_repository_default_applies_the_chat_template(triton, plain, model):
    question = {"text_input": "What is the capital of France?", "max_tokens": 32}
    chat = generate(triton.http, model, {**question, "apply_chat_template": True}).json()
    assert chat["text_output"].strip()
    out = infer("http", plain.http, model, question)
    assert out["text_output"].reshape(-1)[0].decode() == chat["text_output"]


def test_stop_input_answers_once(plain):
    out = infer("grpc", plain.grpc, "tensorrt_llm", {"stop": True}, request_id="nothing-running")
    assert out == {}


def test_the_decoupled_server_refuses_plain_infer(triton):
    """Why the setting exists: Triton refuses infer() on a decoupled model."""
    for protocol, status in (("http", "501"), ("grpc", "StatusCode.UNIMPLEMENTED")):
        with pytest.raises(InferenceServerException, match="decoupled") as err:
            infer(protocol, _url(triton, protocol), "ensemble", {"text_input": PROMPT})
        assert status in f"{err.value.status()} {err.value}", protocol

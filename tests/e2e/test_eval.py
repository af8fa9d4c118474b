"""lm-evaluation-harness through the OpenAI front end scores the served engine as it scores the
Hugging Face model in-process: per choice log-likelihoods within 1e-3, the same answers
(benchmarks/eval/run.py --compare-hf against `python -m ensemble serve --openai-port`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ensemble.server import free_port
from tests.e2e.test_faults import launcher  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def scored_through_the_server(launch, tmp_path, serve_args: list[str], eval_args: list[str]):
    """`benchmarks.eval.run --compare-hf` against a launched server's OpenAI endpoint: its
    result file, after asserting it ran (lm-eval retries a refused request, then fails on a
    closed session: the first refusal says why)."""
    port = free_port()
    served = launch("--openai-port", str(port), *serve_args)
    served.wait_ready()
    served.wait_openai(port)
    out = tmp_path / "eval.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.eval.run",
            "--base-url",
            f"http://localhost:{port}/v1/completions",
            *eval_args,
            "--compare-hf",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    first_errors = [line for line in run.stderr.splitlines() if "failed" in line][:3]
    assert run.returncode == 0, "\n".join(first_errors) + run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(out.read_text())


def test_lm_eval_scores_the_server_as_the_hf_model(launcher, tmp_path):  # noqa: F811
    # half the task's 52 questions here; `make eval` scores them all
    result = scored_through_the_server(launcher, tmp_path, [], ["--limit", "26"])
    assert result["disagreements"] == []
    assert result["served_accuracy"] == result["hf_accuracy"]


def test_mmlu_subset_through_the_server_as_the_hf_model(launcher, tmp_path):  # noqa: F811
    """100 MMLU questions (each topic's shortest in turn: all 57 topics), 0-shot, through the
    OpenAI endpoint on the default model: every answer and log-likelihood as transformers gives
    them."""
    # each topic's shortest questions: all 57 topics, ~2.5x fewer tokens
    result = scored_through_the_server(
        launcher, tmp_path, ["--max-seq-len", "1024"], ["--task", "mmlu", "--shortest", "100"]
    )
    assert result["questions"] == 100 and result["disagreements"] == []
    assert result["agreement"] == 1.0
    assert result["served_accuracy"] == result["hf_accuracy"]
    assert result["served_accuracy_per_topic"] == result["hf_accuracy_per_topic"]
    assert len(result["served_accuracy_per_topic"]) == 57

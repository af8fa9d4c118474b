"""Speculative decoding through a real tritonserver: a server started with `--speculative-method
ngram` answers as it answers without it, and its metrics count the drafts the engine made and
accepted (vLLM's spec_decode counters under our prefix)."""

from __future__ import annotations

import pytest
import requests

from tests.e2e.test_faults import launcher  # noqa: F401 (the fixture)
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
# Repetitive text: the greedy continuation repeats it, so prompt-lookup drafts get accepted.
PROMPT = "red green blue, red green blue, red green blue, red green blue, red green blue,"


def spec_decode_counts(metrics_port: int) -> dict[str, float]:
    text = requests.get(f"http://localhost:{metrics_port}/metrics", timeout=2).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("nv_llm_spec_decode_metrics{"):
            name = line.split('spec_decode_metric="')[1].split('"')[0]
            counts[name] = float(line.split()[-1])
    return counts


def generate(http_port: int) -> str:
    body = {"text_input": PROMPT, "max_tokens": 32, "end_id": -1}
    url = f"http://localhost:{http_port}/v2/models/ensemble/generate"
    response = requests.post(url, json=body, timeout=120)
    assert response.ok, response.text
    return response.json()["text_output"]


def test_ngram_speculation_serves_the_same_text_and_counts_its_drafts(launcher):  # noqa: F811
    plain = launcher()
    plain.wait_ready()
    expected = generate(plain.http)
    assert spec_decode_counts(plain.metrics).get("num_drafts", 0) == 0
    plain.close()

    speculating = launcher("--speculative-method", "ngram")
    speculating.wait_ready()
    assert generate(speculating.http) == expected
    wait_until(
        lambda: spec_decode_counts(speculating.metrics).get("num_accepted_tokens", 0) > 0,
        "accepted drafts in the server's metrics",
        timeout_s=10,
        poll_s=0.2,
    )
    counts = spec_decode_counts(speculating.metrics)
    assert counts["num_drafts"] > 0
    assert counts["num_draft_tokens"] >= counts["num_accepted_tokens"] > 0

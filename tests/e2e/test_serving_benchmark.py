"""The serving benchmark's clients against the session's server: with `timeline`, each request
carries the engine's times, and on one clock its stages follow one another."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_timeline_stages_are_in_order(triton, tokenizer):
    from benchmarks.serving_load import LoadRequest, Target, run_clients, summarize
    from preprocessing.tokenizer import encode

    texts = ["Hello, my name is", "The capital of France is", "One two three"]
    requests = [LoadRequest(t, encode(tokenizer, t), 4) for t in texts]
    records = run_clients(Target("grpc", "ensemble", triton.grpc, timeline=True), requests, 2, 1)
    assert all(r.error is None and r.engine for r in records)
    for r in records:
        e = r.engine
        assert r.sent < e["arrival"] <= e["first_scheduled"] <= e["first_token"] <= e["last_token"]
        assert e["first_token"] < r.first and e["last_token"] < r.last
    stages = summarize(records, requests)["timeline_ms"]
    assert all(stage["p50"] >= 0 for stage in stages.values())

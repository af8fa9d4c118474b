"""The serving benchmark's clients against the session's server: with `timeline`, each request
carries the engine's times, and on one clock its stages follow one another; its OpenAI target
(the front end it starts as `ensemble serve` does) streams the ensemble's text, and every
client's events are counted with the gaps between them."""

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


def test_openai_target_streams_the_ensembles_text_with_its_event_gaps(triton, tokenizer):
    from benchmarks.serving import start_front_end
    from benchmarks.serving_load import LoadRequest, Target, run_clients, summarize
    from preprocessing.tokenizer import encode

    texts = ["Hello, my name is", "The capital of France is", "One two three"]
    requests = [LoadRequest(t, encode(tokenizer, t), 6) for t in texts]
    front_end, name = start_front_end(triton.settings)
    try:
        openai = run_clients(Target("openai", name, f"localhost:{front_end.port}"), requests, 2, 1)
    finally:
        front_end.stop()
    ensemble = run_clients(Target("http", "ensemble", triton.http), requests, 2, 1)
    assert [r.error for r in openai] == [None] * 3
    assert [r.output for r in openai] == [r.output for r in ensemble]
    for records in (openai, ensemble):
        row = summarize(records, requests)
        assert all(r.responses >= 2 and len(r.gaps) == r.responses - 1 for r in records)
        assert row["event_gap_ms"]["p50"] > 0

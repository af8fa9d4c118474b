"""The serving benchmark's engine-alone closed loop, with and without arrival jitter, on a tiny
random model: every request served once, with its exact length, never more in flight than the
concurrency."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.engine.executor import Executor
from benchmarks.serving import stats_counts, step_counts
from benchmarks.serving_load import LoadRequest, engine_closed_loop, summarize
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", path)
    ex = Executor(EngineConfig(model_path=str(path), device="cpu", max_seq_len=128))
    yield ex
    ex.shutdown()


@pytest.mark.parametrize("jitter_s", [0.0, 0.02])
def test_closed_loop_serves_each_request_once_within_its_concurrency(executor, jitter_s):
    requests = [LoadRequest(f"r{i}", [3 + i, 4, 5, 6], 3 + i % 4) for i in range(10)]
    before = executor.stats()
    records = engine_closed_loop(executor, requests, 3, jitter_s=jitter_s)
    after = executor.stats()

    assert [len(r.output) for r in records] == [req.output_len for req in requests]
    assert all(r.error is None for r in records)
    for r in records:  # at each send, at most 2 others are between their send and their end
        overlapping = [o for o in records if o is not r and o.sent <= r.sent < o.last]
        assert len(overlapping) <= 2
    row = summarize(records, requests)
    steps = step_counts(stats_counts(before), stats_counts(after), row)
    assert steps["engine_steps"] >= max(req.output_len for req in requests)
    assert 1 <= steps["engine_context_steps"] <= steps["engine_steps"]
    assert steps["tokens_per_step"] == row["output_tokens"] / steps["engine_steps"]
    assert 0 <= steps["host_share"] <= 1
    # Every event is counted, and each gap between two of a request's events is measured.
    assert sum(len(r.gaps or ()) for r in records) == sum(r.responses - 1 for r in records)
    assert row["event_gap_ms"]["max"] <= 1e3 * max(r.last - r.first for r in records)


def test_event_gaps_show_a_burst_that_the_average_hides():
    """Ten tokens in three events: the inter-token average says 0.1 s, the gaps 0.1 and 0.8 s."""
    from benchmarks.serving_load import Record

    rec = Record(0, sent=0.0, tokens=10)
    for now in (0.05, 0.15, 0.95):
        rec.event(now)
    row = summarize([rec], [LoadRequest("r", [1], 10)])
    assert rec.responses == 3 and rec.gaps == pytest.approx([0.1, 0.8])
    assert row["itl_ms"]["p50"] == pytest.approx(100.0)
    assert row["event_gap_ms"]["max"] == pytest.approx(800.0)

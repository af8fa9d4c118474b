"""The signals the Kubernetes deployment relies on, read from a real server started as the chart's
pod starts it: readiness comes only after the LLM model finished loading (its engine warmed up),
and the queue gauge the HPA scales on counts the requests that wait for a batch slot.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.e2e.clients import GrpcStream, metric, metrics
from tests.e2e.test_faults import LONG, launcher  # noqa: F401 (the fixture)

pytestmark = pytest.mark.e2e
ADAPTER_VALUES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus-adapter-values.yaml"
MAX_BATCH = 4
CLIENTS = 12
STATS_PERIOD_MS = 200


def _status(url: str) -> int | None:
    try:
        return requests.get(url, timeout=1).status_code
    except requests.RequestException:
        return None


def _waiting_series() -> tuple[str, dict]:
    """The series prometheus-adapter serves as tritonllm_requests_waiting: (name, labels)."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    (rule,) = [r for r in rules if r["name"]["as"] == "tritonllm_requests_waiting"]
    name, selector = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"]).groups()
    return name, dict(re.findall(r'(\w+)="(\w+)"', selector))


def test_ready_after_warm_up_and_the_queue_gauge_counts_waiting_requests(launcher):  # noqa: F811
    served = launcher(
        "--max-batch-size", str(MAX_BATCH), "--stats-check-period-ms", str(STATS_PERIOD_MS)
    )
    base = f"http://localhost:{served.http}/v2"
    deadline = time.monotonic() + 300
    while _status(f"{base}/health/ready") != 200:
        assert served.process.poll() is None, served.log.read_text()[-3000:]
        assert time.monotonic() < deadline, "not ready"
        time.sleep(0.2)
    # The first ready answer comes after the LLM model's initialize() returned, which it does
    # only once the engine process loaded the model and warmed up ("tensorrt_llm_0_0 ready").
    log = served.log.read_text()
    assert re.search(r"tensorrt_llm_0_\d+ ready: engine process", log), log[-3000:]
    assert _status(f"{base}/models/tensorrt_llm/ready") == 200

    streams = []
    try:
        for i in range(CLIENTS):
            stream = GrpcStream(f"localhost:{served.grpc}")
            stream.send("ensemble", LONG, request_id=f"long-{i}")
            streams.append(stream)
        name, labels = _waiting_series()
        url = f"http://localhost:{served.metrics}/metrics"
        deadline = time.monotonic() + 30
        while True:
            samples = metrics(url)
            counts = (
                metric(samples, "nv_trt_llm_request_metrics", request_type="active"),
                metric(samples, name, **labels),
            )
            if counts == (MAX_BATCH, CLIENTS - MAX_BATCH) or time.monotonic() > deadline:
                break
            time.sleep(STATS_PERIOD_MS / 1000)
        assert counts == (MAX_BATCH, CLIENTS - MAX_BATCH), f"active, waiting = {counts}"
        time.sleep(STATS_PERIOD_MS / 1000)  # one stats period later: still so (long requests)
        samples = metrics(url)
        assert metric(samples, "nv_trt_llm_request_metrics", request_type="active") == MAX_BATCH
        assert metric(samples, name, **labels) == CLIENTS - MAX_BATCH
    finally:
        for stream in streams:
            stream.close(cancel=True)

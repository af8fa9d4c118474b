"""tensor_parallel_size served through Triton on CPU: the default model split across 3 ranks
(its 9 heads on 3 KV heads do not split in 2) gives the session's one-rank server's greedy text
through the ensemble, streamed or not, and its metrics are served; then a killed worker rank
fails the request in flight with an error naming it and the server stops (not ready), with no
hang. One extra server for the module."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from tests.e2e.clients import generate, generate_stream, metric, metrics
from tests.e2e.conftest import running_triton

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    with running_triton(tmp_path_factory.mktemp("triton-tp"), tensor_parallel_size=3) as server:
        yield server


def test_three_ranks_generate_one_ranks_text_and_serve_metrics(triton, split):
    assert "tensor-parallel rank 2 of 3" in split.log_file.read_text()
    for prompt in PROMPTS:
        payload = {"text_input": prompt, "max_tokens": 24}
        texts = []
        for server in (triton, split):
            response = generate(server.http, "ensemble", payload)
            assert response.status_code == 200, response.text
            texts.append(response.json()["text_output"])
        assert texts[0] == texts[1] and texts[0].strip(), prompt
    events = generate_stream(split.http, "ensemble", {**payload, "stream": True})
    assert "".join(e["text_output"] for e in events) == texts[0]
    samples = metrics(split.metrics)
    steps = metric(samples, "nv_trt_llm_general_metrics", general_type="iteration_counter")
    assert steps >= 24 * len(PROMPTS)
    max_requests = metric(samples, "nv_trt_llm_request_metrics", request_type="max")
    assert max_requests == split.settings.max_batch_size


def test_a_killed_worker_fails_the_request_and_stops_the_server(split):
    engine = int(re.search(r"engine process (\d+)", split.log_file.read_text()).group(1))
    workers = [pid for pid in _children(engine) if "spawn_main" in _cmdline(pid)]
    workers = [pid for pid in workers if "resource_tracker" not in _cmdline(pid)]
    assert len(workers) == 2, workers
    result = {}

    def long_request():
        payload = {"text_input": "Count to a thousand:", "max_tokens": 400}
        result["response"] = generate(split.http, "ensemble", payload, timeout=60)

    client = threading.Thread(target=long_request)
    client.start()
    time.sleep(2.0)  # the request is decoding
    os.kill(workers[0], 9)
    client.join(60)
    assert not client.is_alive(), "the request hangs"
    response = result["response"]
    assert response.status_code != 200 and "tensor-parallel rank" in response.text, response.text
    deadline = time.monotonic() + 60
    while split.server.is_ready():
        assert time.monotonic() < deadline, "the server is still ready"
        time.sleep(0.5)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()

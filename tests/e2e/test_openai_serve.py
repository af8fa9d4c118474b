"""`python -m ensemble serve --openai-port` as users run it: the OpenAI front end starts once
Triton is ready, a full engine queue reads 429 (OpenAI's "retry later"), a SIGTERM stops both
cleanly, and a front end that dies stops the server (exit non-zero, for a supervisor)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import requests

from ensemble.processes import descendants
from ensemble.server import free_port
from tests.e2e.test_faults import _cmdline, _gauge, _wait_streaming, launcher  # noqa: F401

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.e2e


def _front_end(served, port: int):
    """The front end's pid and a client, once it answers healthy."""
    url = f"http://localhost:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert served.process.poll() is None, served.log.read_text()[-3000:]
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "the OpenAI front end did not start"
        time.sleep(0.3)
    pid = next(
        p for p in descendants(served.process.pid) if "ensemble.openai_server" in _cmdline(p)
    )
    model = requests.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
    return pid, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), model


def _long_request_in_background(client, model: str, errors: list) -> threading.Thread:
    def run():
        try:
            for _ in client.completions.create(
                model=model,
                prompt="Count from one to one thousand:",
                max_tokens=480,
                extra_body={"ignore_eos": True},
                stream=True,
            ):
                pass
        except openai.APIError as exc:  # the server stops under it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_full_queue_reads_429_and_sigterm_stops_both(launcher):  # noqa: F811
    port = free_port()
    served = launcher("--max-batch-size", "1", "--max-queue-size", "1", "--openai-port", str(port))
    served.wait_ready()
    pid, client, model = _front_end(served, port)
    errors: list = []
    threads = [_long_request_in_background(client, model, errors)]
    _wait_streaming(served, 1)
    threads.append(_long_request_in_background(client, model, errors))
    deadline = time.monotonic() + 30
    while _gauge(served, "waiting") < 1:  # one running, one waiting: the queue is full
        assert time.monotonic() < deadline, f"the second request never waited: {errors}"
        time.sleep(0.2)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as refused:
            reply = client.completions.create(model=model, prompt="Hi", max_tokens=4, stream=stream)
            list(reply) if stream else reply
        assert refused.value.status_code == 429
        assert refused.value.body["code"] == "rate_limit_exceeded"
        assert "retry later" in refused.value.body["message"]

    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=30) == 0
    assert not os.path.exists(f"/proc/{pid}"), "the front end lives on"
    for thread in threads:
        thread.join(timeout=10)


def test_a_dead_front_end_stops_the_server(launcher):  # noqa: F811
    port = free_port()
    served = launcher("--openai-port", str(port))
    served.wait_ready()
    pid, client, model = _front_end(served, port)
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).usage.total_tokens
    server_pid = served.server_pid()
    os.kill(pid, signal.SIGKILL)
    assert served.process.wait(timeout=30) == 1
    assert "the OpenAI front end exited" in served.log.read_text()
    assert not os.path.exists(f"/proc/{server_pid}"), "tritonserver lives on"


def test_a_taken_openai_port_is_refused_before_starting(launcher):  # noqa: F811
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        served = launcher("--openai-port", str(port))
        code = served.process.wait(timeout=60)
    output = served.log.read_text()
    assert code == 2 and f"openai_port {port} is already in use" in output, output
    assert "ready:" not in output

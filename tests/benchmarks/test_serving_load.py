"""The serving benchmark's client side stops a load whose server is gone or silent, at once,
instead of waiting on streams that will never answer (a socket that accepts connections but
never speaks stands for a hung server)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from benchmarks.serving_load import LoadRequest, Target, run_clients

pytest.importorskip("tritonclient.grpc")


@pytest.fixture
def silent_server():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # the kernel accepts; nobody answers
        yield f"127.0.0.1:{sock.getsockname()[1]}"


REQUESTS = [LoadRequest("hello", [5, 6, 7], 4)] * 4


def load_error(url: str, **options) -> str:
    """The RuntimeError a closed loop of 2 against `url` stops with (failing, not hanging, when
    it does not stop within 30 s)."""
    raised: list[BaseException] = []

    def run():
        try:
            run_clients(Target("grpc", "ensemble", url), REQUESTS, 2, 1, **options)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the load did not stop"
    assert raised and isinstance(raised[0], RuntimeError), raised
    return str(raised[0])


def test_a_load_stops_as_soon_as_its_server_is_gone(silent_server):
    began = time.monotonic()

    def gone():
        return "tritonserver exited with code -6" if time.monotonic() - began > 3 else None

    error = load_error(silent_server, gone=gone)
    assert error == "the load stopped: tritonserver exited with code -6"


def test_a_load_stops_when_no_request_finishes(silent_server):
    error = load_error(silent_server, stall_s=3)
    assert error == "the load stopped: no request finished for 3 s"

"""Faults and lifecycle of a served repository, through `python -m ensemble serve` as users run it.

A stub that dies fails its clients and stops the server (exit non-zero, for a supervisor), and so
does a server that stops answering its liveness endpoint; a
signal (SIGTERM, SIGHUP) ends the requests in flight with "shutting down" and stops the server
fast and clean; a taken port or a bad model path is refused before anything starts; the LLM's
processes do not grow under a stream of short requests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from ensemble.processes import SHM_DIR, SHM_PATTERN, cmdline, descendants, engine_processes
from ensemble.server import free_port
from tests.e2e.clients import grpc_request

pytestmark = pytest.mark.e2e
PROJECT = Path(__file__).resolve().parents[2]
SMALL = [
    "--device",
    "cpu",
    "--max-batch-size",
    "8",
    "--max-seq-len",
    "512",
    "--max-tokens-in-paged-kv-cache",
    "4096",
    "--cancellation-check-period-ms",
    "50",
    "--openai-port",  # no OpenAI front end unless a test asks for one on a free port
    "0",
]
LONG = {"text_input": "Count from one to one thousand:", "max_tokens": 480, "end_id": -1}


def _cmdline(pid: int) -> str:
    return cmdline(pid).replace(b"\0", b" ").decode()


class Launcher:
    """`python -m ensemble serve` on free ports, its output in a file."""

    def __init__(self, tmp_path: Path, *args: str):
        self.http, self.grpc, self.metrics = free_port(), free_port(), free_port()
        self.log = tmp_path / "serve.log"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ensemble",
                "serve",
                *SMALL,
                "--http-port",
                str(self.http),
                "--grpc-port",
                str(self.grpc),
                "--metrics-port",
                str(self.metrics),
                *args,
            ],
            cwd=PROJECT,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def ready(self) -> bool:
        try:
            return requests.get(f"http://localhost:{self.http}/v2/health/ready", timeout=1).ok
        except requests.RequestException:
            return False

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.5)

    def wait_openai(self, port: int, timeout: float = 120) -> str:
        """Until its OpenAI front end on `port` answers; the model name it serves."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                response = requests.get(f"http://localhost:{port}/v1/models", timeout=2)
                if response.ok:
                    return response.json()["data"][0]["id"]
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "the OpenAI front end did not answer"
            time.sleep(0.3)

    def server_pid(self) -> int:
        return next(p for p in descendants(self.process.pid) if "tritonserver" in _cmdline(p))

    def stub(self, model: str) -> int:
        return next(
            p for p in descendants(self.server_pid()) if f"/{model}/1/model.py" in _cmdline(p)
        )

    def close(self) -> None:
        """Stop the launcher as a supervisor would (SIGTERM: it removes its repository and what
        the server left), killing it only when it does not exit."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def launcher(tmp_path):
    started = []

    def start(*args: str) -> Launcher:
        started.append(Launcher(tmp_path, *args))
        return started[-1]

    yield start
    for each in started:
        each.close()


def _stream_in_background(url: str, results: list, model: str = "ensemble") -> threading.Thread:
    def run():
        start = time.monotonic()
        result = grpc_request(url, model, LONG, timeout=120)
        results.append((result, time.monotonic() - start))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _gauge(launcher: Launcher, request_type: str) -> float:
    """The engine's request gauge of this type (active, waiting, ...), 0 before the first poll."""
    text = requests.get(f"http://localhost:{launcher.metrics}/metrics", timeout=2).text
    label = f'request_type="{request_type}"'
    for line in text.splitlines():
        if line.startswith("nv_trt_llm_request_metrics") and label in line:
            return float(line.split()[-1])
    return 0.0


def _wait_streaming(launcher: Launcher, count: int, timeout: float = 60) -> None:
    """Until `count` requests run in the engine (the gauge of active requests says so)."""
    deadline = time.monotonic() + timeout
    while _gauge(launcher, "active") < count:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.2)


@pytest.mark.parametrize("model", ["tensorrt_llm", "postprocessing"])
def test_a_killed_stub_fails_its_clients_and_stops_the_server(launcher, model):
    served = launcher()
    served.wait_ready()
    shm_before = set(SHM_DIR.glob(SHM_PATTERN))
    server_pid = served.server_pid()
    engine = engine_processes(server_pid)[0]
    results: list = []
    threads = [_stream_in_background(f"localhost:{served.grpc}", results) for _ in range(3)]
    _wait_streaming(served, 3)
    killed_at = time.monotonic()
    os.kill(served.stub(model), signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 3
    for result, _ in results:
        assert result.error is not None, "a client of the dead stub got no error"
    assert time.monotonic() - killed_at < 10, "the clients waited more than 10 s for their error"
    assert not served.ready()
    code = served.process.wait(timeout=30)
    assert code != 0, "the launcher must exit non-zero so that a supervisor restarts it"
    assert "died; stopping tritonserver" in served.log.read_text()
    assert not Path(f"/proc/{server_pid}").exists(), "tritonserver lives on"
    assert not Path(f"/proc/{engine}").exists(), "the engine process lives on"
    assert not set(SHM_DIR.glob(SHM_PATTERN)) - shm_before, "shared memory left behind"


def test_a_hung_server_is_stopped_for_a_supervisor_to_restart(launcher):
    """tritonserver stopped (SIGSTOP: every thread frozen, as a server caught in its abort
    handler) no longer answers /v2/health/live: the launcher kills it and its processes at
    once (no graceful stop's wait for a SIGINT it cannot handle) and exits 1."""
    served = launcher("--health-timeout-s", "3")
    served.wait_ready()
    shm_before = set(SHM_DIR.glob(SHM_PATTERN))
    server_pid = served.server_pid()
    engine = engine_processes(server_pid)[0]
    time.sleep(4)  # answered probes: a live server is left alone
    assert served.process.poll() is None
    os.kill(server_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    assert served.process.wait(timeout=40) == 1
    # 3 s to be found hung, 1 s for the engines to drain, the kill; a graceful stop took 19 s+
    assert time.monotonic() - stopped_at < 15, "the hung server was not killed at once"
    assert "has not answered /v2/health/live for 3 s" in served.log.read_text()
    assert not Path(f"/proc/{server_pid}").exists(), "the hung tritonserver lives on"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{engine}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{engine}").exists(), "the engine process lives on"
    assert not set(SHM_DIR.glob(SHM_PATTERN)) - shm_before, "shared memory left behind"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_drains_and_stops_fast_and_clean(launcher, signum):
    served = launcher()
    served.wait_ready()
    server_pid = served.server_pid()
    repository = next(
        a for a in _cmdline(server_pid).split() if a.startswith("--model-repository=")
    )
    shm_before = set(SHM_DIR.glob(SHM_PATTERN))
    results: list = []
    threads = [_stream_in_background(f"localhost:{served.grpc}", results) for _ in range(3)]
    _wait_streaming(served, 3)
    signalled_at = time.monotonic()
    served.process.send_signal(signum)
    for thread in threads:
        thread.join(timeout=30)
    for result, _ in results:
        assert result.error is not None and "shutting down" in result.error, result.error
    assert served.process.wait(timeout=30) == 0
    assert time.monotonic() - signalled_at < 10, "shutdown took more than 10 s"
    assert not Path(f"/proc/{server_pid}").exists(), "tritonserver outlived its launcher"
    assert not Path(repository.split("=", 1)[1]).exists(), "the temporary repository is left"
    assert not set(SHM_DIR.glob(SHM_PATTERN)) - shm_before, "shared memory left behind"


def test_ctrl_c_ends_openai_and_triton_streams_alike_and_quietly(launcher):
    """Ctrl-C (SIGINT to the launcher: the front end has a session of its own) with a stream
    open on each front end: the engines drain first, so the OpenAI stream ends with the
    shutting-down error event and [DONE] (not cut) and the gRPC stream with the same error; the
    launcher exits 0 within 10 s and nothing prints "Error in sys.excepthook"."""
    openai_port = free_port()
    served = launcher("--openai-port", str(openai_port))
    served.wait_ready()
    model = served.wait_openai(openai_port)
    events: list[str] = []

    def stream_openai():
        body = {
            "model": model,
            "prompt": LONG["text_input"],
            "max_tokens": LONG["max_tokens"],
            "ignore_eos": True,
            "stream": True,
        }
        url = f"http://localhost:{openai_port}/v1/completions"
        with requests.post(url, json=body, stream=True, timeout=120) as response:
            events.extend(line for line in response.iter_lines(decode_unicode=True) if line)

    results: list = []
    threads = [
        threading.Thread(target=stream_openai, daemon=True),
        _stream_in_background(f"localhost:{served.grpc}", results),
    ]
    threads[0].start()
    _wait_streaming(served, 2)
    signalled_at = time.monotonic()
    served.process.send_signal(signal.SIGINT)
    for thread in threads:
        thread.join(timeout=30)
    assert served.process.wait(timeout=30) == 0
    assert time.monotonic() - signalled_at < 10, "shutdown took more than 10 s"
    assert events[-1] == "data: [DONE]", events[-3:]
    assert "shutting down" in events[-2] and '"error"' in events[-2], events[-3:]
    assert results and "shutting down" in results[0][0].error, results
    assert "Error in sys.excepthook" not in served.log.read_text(errors="replace")


def test_a_taken_port_is_refused_before_starting(launcher):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        served = launcher("--grpc-port", str(port))  # the last --grpc-port given wins
        code = served.process.wait(timeout=60)
    output = served.log.read_text()
    assert code == 2 and f"grpc_port {port} is already in use" in output, output
    assert "ready:" not in output and "tritonserver" not in output
    assert time.monotonic() - started < 30


def test_a_bad_model_path_is_refused_before_building(tmp_path):
    out = tmp_path / "repository"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ensemble",
            "build",
            "--model",
            "/does/not/exist",
            "--out",
            str(out),
        ],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "model '/does/not/exist' not found" in result.stderr
    assert not out.exists()


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_the_llm_processes_do_not_grow_under_short_requests(triton):
    server = triton.server.process.pid
    stubs = [p for p in descendants(server) if "/tensorrt_llm/1/model.py" in _cmdline(p)]
    (engine,) = engine_processes(server)  # one, whichever instance started it
    processes = {**{f"stub {s}": s for s in stubs}, "engine process": engine}
    request = {
        "input_ids": [1, 2, 3, 4, 5],
        "input_lengths": 5,
        "request_output_len": 4,
        "end_id": -1,
    }

    def send(i: int) -> None:  # distinct prompts: each takes fresh KV blocks
        result = grpc_request(triton.grpc, "tensorrt_llm", dict(request, input_ids=[i, 2, 3, 4, 5]))
        assert result.error is None, result.error

    sizes = {}
    with ThreadPoolExecutor(max_workers=6) as pool:
        for start, end in ((1, 51), (51, 201)):  # a leak of 0.5 MB a request shows
            list(pool.map(send, range(start, end)))
            sizes[end - 1] = {name: _rss_mb(pid) for name, pid in processes.items()}
    for name in processes:
        grown = sizes[200][name] - sizes[50][name]
        assert grown < 64, f"the {name} grew {grown:.0f} MB"


def test_a_full_queue_reads_try_again_later_and_is_counted(launcher):
    served = launcher("--max-batch-size", "1", "--max-queue-size", "1")
    served.wait_ready()
    results: list = []
    # One at a time: two arriving together may both queue, and the second is then refused.
    threads = [_stream_in_background(f"localhost:{served.grpc}", results)]
    _wait_streaming(served, 1)
    threads.append(_stream_in_background(f"localhost:{served.grpc}", results))
    deadline = time.monotonic() + 30
    while _gauge(served, "waiting") < 1:  # one running, one waiting: the queue is full
        assert time.monotonic() < deadline, f"the second request never waited: {results}"
        time.sleep(0.2)
    response = requests.post(
        f"http://localhost:{served.http}/v2/models/ensemble/generate",
        json={"text_input": "Hi", "max_tokens": 4},
        timeout=60,
    )
    # Triton 2.51's generate endpoints answer every model error with 400: the text says why.
    assert response.status_code == 400, (response.status_code, response.text)
    assert "maximum queue size" in response.json()["error"]
    assert "retry later" in response.json()["error"]
    refused = grpc_request(
        f"localhost:{served.grpc}", "ensemble", {"text_input": "Hi", "max_tokens": 4}
    )
    # A gRPC stream carries an error's text only, not its code.
    assert refused.error is not None and "retry later" in refused.error, refused.error
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = requests.get(f"http://localhost:{served.metrics}/metrics", timeout=2).text
        counted = [
            line
            for line in text.splitlines()
            if line.startswith("nv_llm_requests_rejected_total") and "queue_full" in line
        ]
        if counted and float(counted[0].split()[-1]) >= 2:
            break
        time.sleep(0.2)
    assert counted and float(counted[0].split()[-1]) >= 2, counted
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=30) == 0
    for thread in threads:
        thread.join(timeout=30)

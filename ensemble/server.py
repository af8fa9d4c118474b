"""Start and stop tritonserver (found by `ensemble.triton_install`: the nvidia-pytriton wheel's,
or a system install's). The server is started from the stubs' environment (see environment.py:
this one, or a serving environment with numpy < 2), so the stubs import its packages (ours via
PYTHONPATH); the engine process runs under this interpreter.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backend.process.client import ENGINE_PYTHON_ENV
from ensemble.environment import StubEnvironment, stub_environment
from ensemble.processes import (
    SHM_DIR,
    SHM_PATTERN,
    engine_processes,
    remove_orphan_shm_regions,
    send_signal,
    wait_group_gone,
    with_parent,
)
from ensemble.triton_install import TritonInstall, locate_tritonserver, prepare_backends

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DRAIN_S = 1.0
# Triton 2.51 keeps a model loaded while a client holds a gRPC stream that used it, waits its exit
# timeout for it, then hangs: past these the server is killed and its shared memory removed.
EXIT_TIMEOUT_S = 5
STOP_TIMEOUT_S = 15.0


def check_ports_free(ports: dict[str, int]) -> None:
    """Raise OSError naming the setting of the first port something already listens on (as
    tritonserver binds them: all interfaces); 0 = the port is not used."""
    for name, port in ports.items():
        if not port:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as exc:
                raise OSError(
                    f"{name} {port} is already in use ({exc.strerror}): stop what "
                    f"listens there or choose another --{name.replace('_', '-')}"
                ) from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class TritonServer:
    repository: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_file: Path | None = None  # None = inherit the terminal
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    _shm_before: set = field(default_factory=set)
    _drained: bool = False

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall, backends: Path) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={Path(self.repository).resolve()}",
            f"--backend-directory={backends}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            *self.extra_args,
        ]

    def environment(self, install: TritonInstall, stubs: StubEnvironment) -> dict[str, str]:
        env = dict(os.environ)
        # The stub must load this interpreter's libpython (not, say, the distribution's), or
        # the standard library's extension modules fail with undefined symbols.
        libdir = sysconfig.get_config_var("LIBDIR")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, env.get("LD_LIBRARY_PATH"), str(install.libs)) if p
        )
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p
        )
        env[ENGINE_PYTHON_ENV] = env.get(ENGINE_PYTHON_ENV) or sys.executable  # torch, CUDA
        if stubs.prefix != Path(sys.base_prefix):  # the stubs' virtual environment
            env["VIRTUAL_ENV"] = str(stubs.prefix)
            env["PATH"] = os.pathsep.join((str(stubs.prefix / "bin"), env.get("PATH", "")))
        return env

    def start(self) -> "TritonServer":
        check_ports_free(
            {
                "http_port": self.http_port,
                "grpc_port": self.grpc_port,
                "metrics_port": self.metrics_port,
            }
        )
        install = locate_tritonserver()
        backends = prepare_backends(install)
        stubs = stub_environment()
        self._shm_before = set(SHM_DIR.glob(SHM_PATTERN))
        self._drained = False
        output = open(self.log_file, "ab") if self.log_file else None
        self.process = subprocess.Popen(
            with_parent(self.command(install, backends)),
            env=self.environment(install, stubs),
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
            cwd=PROJECT_ROOT,
        )
        if output:
            output.close()
        return self

    def is_ready(self) -> bool:
        try:
            url = f"http://localhost:{self.http_port}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {self.process.returncode}" + self._log_tail()
                )
            if self.is_ready() and (self.process is None or self.process.poll() is None):
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s" + self._log_tail())

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Drain the engines (requests in flight end with "the server is shutting down", so Triton
        has none to wait for), shut down gracefully (SIGINT: Triton unloads the models), kill what
        is left after `timeout_s`; after any unclean end, also what the server left behind."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.drain()
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        if self.process.poll() != 0:  # killed, crashed or hung: its stubs and engine may live on
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
            wait_group_gone(self.process.pid)
        # Also after a clean exit: a stub that died, or one Triton stopped waiting for at its exit
        # timeout, leaves its region behind.
        remove_orphan_shm_regions(self._shm_before)
        return self.process.returncode

    def drain(self) -> None:
        """End the requests in flight: each engine answers them "the server is shutting down"
        and refuses new ones; wait while those ends pass through the ensembles (and reach the
        OpenAI front end's streams). Once per server; `stop` drains first if no one did."""
        if self._drained or self.process is None or self.process.poll() is not None:
            return
        self._drained = True
        engines = engine_processes(self.process.pid)
        for pid in engines:
            send_signal(pid, signal.SIGTERM)
        if engines:
            time.sleep(DRAIN_S)

    def curl_example(self, chat_template: bool = True) -> str:
        """A request to copy: a question in the model's chat template (an instruct model may
        answer "" to a bare question), or a text to continue for a model without a template
        (preprocessing refuses apply_chat_template for it)."""
        body = (
            '{"text_input": "What is the capital of France?", "max_tokens": 32, '
            '"apply_chat_template": true}'
            if chat_template
            else '{"text_input": "The capital of France is", "max_tokens": 32}'
        )
        return f"curl -s -X POST localhost:{self.http_port}/v2/models/ensemble/generate -d '{body}'"

    def _log_tail(self, lines: int = 40) -> str:
        if not self.log_file or not Path(self.log_file).exists():
            return ""
        tail = Path(self.log_file).read_text(errors="replace").splitlines()[-lines:]
        return "\n--- tritonserver log (tail) ---\n" + "\n".join(tail)

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LivenessWatch:
    """Whether a running server has stopped answering /v2/health/live for `timeout_s`: hung,
    e.g. in Triton 2.51's abort handler after a heap corruption, which can loop while the process
    lives on. Probes at most every `period_s`, each waiting up to `period_s` for the answer."""

    def __init__(self, http_port: int, timeout_s: float):
        self.url = f"http://localhost:{http_port}/v2/health/live"
        self.timeout_s = timeout_s
        self.period_s = min(5.0, timeout_s / 3)
        self.last_answer = self.last_probe = time.monotonic()

    def hung(self) -> bool:
        now = time.monotonic()
        if self.timeout_s <= 0 or now - self.last_probe < self.period_s:
            return False
        self.last_probe = now
        try:
            with urllib.request.urlopen(self.url, timeout=self.period_s) as response:
                if response.status == 200:
                    self.last_answer = time.monotonic()
        except OSError:
            pass
        return time.monotonic() - self.last_answer > self.timeout_s


def serve_forever(
    server: TritonServer,
    front_end=None,
    health_timeout_s: float = 0.0,
    chat_template: bool = True,
) -> int:
    """Start, wait until ready, print how to call it (`chat_template`: whether the model has one,
    for the request printed), and stop cleanly on Ctrl-C, SIGTERM or
    SIGHUP (a closed terminal). Returns tritonserver's exit code (128 + signal if killed), so a
    supervisor sees a server that died as a failure. `front_end` (an
    ensemble.openai_server.process.FrontEndProcess) starts once the server is ready; its death
    stops the server too (exit code 1), and so does a server that has not answered
    /v2/health/live for `health_timeout_s` (0: never)."""
    for signum in (
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGINT,
    ):  # SIGINT: also when started with `&`
        signal.signal(signum, _interrupt)
    server.start()
    hung = False
    try:
        server.wait_ready()
        print(
            f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}"
        )
        print(server.curl_example(chat_template), flush=True)
        if front_end is not None:
            front_end.start()
            wait_listening(front_end.port, front_end.exit_code)
            print(f"OpenAI-compatible endpoint: {front_end.url}", flush=True)
        liveness = LivenessWatch(server.http_port, health_timeout_s)
        while True:
            code = server.process.poll()
            if code is not None:
                code = 128 - code if code < 0 else code
                print(f"tritonserver exited with code {code}", file=sys.stderr, flush=True)
                return code
            if front_end is not None and front_end.exit_code() is not None:
                print(
                    f"the OpenAI front end exited with code {front_end.exit_code()}; "
                    "stopping tritonserver",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            if liveness.hung():
                hung = True
                print(
                    f"tritonserver has not answered /v2/health/live for {health_timeout_s:g} s; "
                    "stopping it (exit code 1, for a supervisor to restart it)",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("stopping tritonserver ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:  # it did not start; the log says why
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Drain first: streams on both front ends end with "the server is shutting down" (the
        # OpenAI ones with an error event and [DONE]), then nothing holds the front end open.
        if not hung:
            server.drain()
        if front_end is not None:
            front_end.stop()
        server.stop(timeout_s=0.0 if hung else STOP_TIMEOUT_S)  # a hung server never handles SIGINT


def wait_listening(port: int, exit_code, timeout_s: float = 120.0) -> None:
    """Until something accepts connections on localhost:`port`; RuntimeError when the process
    (whose `exit_code()` is not None once it ended) exits first, TimeoutError past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if exit_code() is not None:
            raise RuntimeError(f"the process meant to listen on port {port} exited")
        try:
            with socket.create_connection(("localhost", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s:.0f} s")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

"""The handle that drives the engine process (backend/process/service.py) from another process.

Why a process. A server answering the engine's outputs (the Triton model builds response
tensors and makes a send round trip per response) would otherwise hold, in the engine's own
process, the interpreter lock that the engine loop needs between steps: under load the two
took turns and the engine ran at a fraction of its speed. Apart, each has an interpreter of its
own, and they meet once per engine step. The engine may also run under another Python than its
caller: a GPU host's own torch (and numpy 2) while Triton's Python backend, whose stub reads
tensors through numpy 1.x only, runs in an environment of its own.

Why shared. One stub process answers a few hundred requests a second (each response is built in
Python and sent in a round trip to the server). `EngineProcess.shared` lets several processes
(Triton instances of the LLM model) drive one engine: the first starts it under a name, the
others attach to it, and it exits when the last has detached.

When the engine process dies, every request in flight ends with an error output and later
submits raise. When the engine fails (a tensor-parallel rank died), its requests end with an
error output naming the cause; the handle is then no longer `alive`, `fatal` says why, and later
submits raise that message.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection
from pathlib import Path

from backend.config import EngineConfig
from backend.process.outbox import MIDDLE_FIELDS, STATS_PERIOD_S  # noqa: F401  (for callers)
from backend.process.service import (  # noqa: F401  (the protocol's names, for the handle's callers)
    FATAL_EXIT_CODE,
    SHUTTING_DOWN,
    EngineInfo,
    address,
)
from backend.request import FinishReason, RequestOutput
from backend.sampling_params import SamplingParams

log = logging.getLogger(__name__)

ENGINE_PYTHON_ENV = "TRITONLLM_ENGINE_PYTHON"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
ATTACH_RETRY_S = 0.05


def engine_python() -> str:
    """The interpreter that runs the engine: $TRITONLLM_ENGINE_PYTHON, else this one.
    Inside an embedding process (Triton's stub) `sys.executable` is not a Python: then the
    `python3` of the active environment."""
    chosen = os.environ.get(ENGINE_PYTHON_ENV)
    if chosen:
        return chosen
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(Path(sys.prefix) / "bin" / "python3")


class EngineProcess:
    """Drives an engine process like an `Executor`: `submit`, `cancel`, `stats`, `shutdown`.
    Outputs reach each request's callback from the handle's receiver thread, or, with
    `receiver_thread=False`, from `pump` in a thread of the caller's.

    `EngineProcess(config)` starts an engine of its own; `EngineProcess.shared(config, name)`
    attaches to the engine running under `name`, or starts it (`owner` is then True)."""

    def __init__(
        self,
        config: EngineConfig,
        python: str | None = None,
        start_timeout_s: float = 1800.0,
        name: str | None = None,
        receiver_thread: bool = True,
    ):
        config.validate()
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p
        )
        process = subprocess.Popen(
            [python or engine_python(), "-m", "backend.process.service", str(theirs.fileno())]
            + ([name] if name else []),
            pass_fds=(theirs.fileno(),),
            env=env,
            cwd=PROJECT_ROOT,
        )
        theirs.close()
        self._connect(Connection(ours.detach()), config, start_timeout_s, process, receiver_thread)

    @classmethod
    def shared(
        cls,
        config: EngineConfig,
        name: str,
        python: str | None = None,
        start_timeout_s: float = 1800.0,
        receiver_thread: bool = True,
    ) -> EngineProcess:
        """The engine running under `name` (an abstract Unix socket of this host), attached;
        started by this call where none runs. Raises RuntimeError when the engine failed to start
        or runs another configuration."""
        config.validate()
        deadline = time.monotonic() + start_timeout_s
        while True:
            handle = cls._attach(config, name, deadline, receiver_thread)
            if handle is not None:
                return handle
            starting = _take_start_lock(name)  # one caller starts it; the others attach
            if starting is not None:
                with starting:
                    return cls._attach(config, name, deadline, receiver_thread) or cls(
                        config, python, start_timeout_s, name, receiver_thread
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine was ready as {name!r} after {start_timeout_s:.0f} s")
            time.sleep(ATTACH_RETRY_S)

    @classmethod
    def _attach(
        cls, config: EngineConfig, name: str, deadline: float, receiver_thread: bool
    ) -> EngineProcess | None:
        try:
            conn = Client(address(name), family="AF_UNIX")
        except OSError:  # none listens under that name
            return None
        handle = cls.__new__(cls)
        try:
            handle._connect(
                conn, config, max(deadline - time.monotonic(), 1.0), None, receiver_thread
            )
        except (EOFError, ConnectionError):  # it was exiting, or reset us on its way out
            return None
        return handle

    def _connect(
        self, conn: Connection, config, timeout_s: float, process, receiver_thread: bool
    ) -> None:
        self._conn = conn
        self.process: subprocess.Popen | None = process  # only in the handle that started it
        self.owner = process is not None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._callbacks: dict[str, object] = {}
        self._earlier: dict[str, RequestOutput] = {}  # each live request's last whole output
        self._stats = None
        self._exit_error: str | None = None
        self._stopping = False
        self._clients_left: int | None = None  # the engine's answer to our "stop"
        self.fatal: str | None = None  # why the engine failed ("fatal"), once it has
        self.on_stop_user = None  # called with a user id that another client was asked to stop
        try:
            self._conn.send(config)
            self.info: EngineInfo = self._wait_ready(timeout_s)
        except BaseException:
            self._kill()
            self._conn.close()
            raise
        self._gone = False
        self._receiver = None
        if receiver_thread:
            self._receiver = threading.Thread(
                target=self._receive, name="engine-receiver", daemon=True
            )
            self._receiver.start()

    # Executor's attributes, for callers written against it.
    @property
    def model_dir(self) -> str:
        return self.info.model_dir

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.info.max_seq_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self.info.eos_token_ids

    @property
    def alive(self) -> bool:
        return self._exit_error is None

    def submit(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, on_output
    ) -> None:
        """Check and send a request. Raises ValueError for bad input (as `Executor.submit`) and
        RuntimeError when the engine process is gone; a full queue comes back as an output."""
        prompt_ids = list(prompt_ids)
        sampling = self.info.limits.check(prompt_ids, sampling)
        request_id = str(request_id)
        with self._lock:
            if self._exit_error is not None:
                raise RuntimeError(self._exit_error)
            if request_id in self._callbacks:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._callbacks[request_id] = on_output
        self._send(("submit", request_id, prompt_ids, sampling))

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            if request_id not in self._callbacks or self._exit_error is not None:
                return False
        self._send(("cancel", request_id))
        return True

    def stop_user(self, user_id: str) -> None:
        """Tell the engine's other clients that requests of `user_id` are to stop (their
        `on_stop_user` runs); the caller stops its own."""
        if self.alive:
            self._send(("stop_user", user_id))

    def stats(self):
        """The engine's latest statistics (it sends them every STATS_PERIOD_S)."""
        return self._stats

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Detach: this handle's requests in flight end as cancelled. The engine process exits
        once no handle is attached; the one that started it waits for that when it was the last."""
        self._stopping = True
        try:
            self._send(("stop",))
        except OSError:
            pass
        if self._receiver is not None:
            self._receiver.join(timeout=timeout_s)
        else:  # the caller has stopped pumping: read the rest here, up to the engine's goodbye
            deadline = time.monotonic() + timeout_s
            while self.pump(max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    break
        self._conn.close()
        if self.process is None:
            return
        if self._clients_left:  # others still drive it: it exits after them
            threading.Thread(target=self.process.wait, daemon=True).start()
            return
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()

    # ---- internals ----
    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"the engine process exited with code {self.process.returncode} "
                    "while loading the model (its log is above)"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine process was not ready after {timeout_s:.0f} s")
        kind, payload = self._conn.recv()
        if kind == "failed":
            raise RuntimeError(f"the engine failed to start:\n{payload}")
        return payload

    def pump(self, timeout: float | None) -> bool:
        """Deliver every message that has arrived, waiting up to `timeout` s for the first; the
        callbacks run in the calling thread. For a handle made with `receiver_thread=False`,
        whose caller reads in a thread it already has (one thread fewer taking turns at the
        interpreter lock). Returns False once the engine has gone (its requests have ended)."""
        if self._gone:
            return False
        conn = self._conn
        try:
            if not conn.poll(timeout):
                return True
            while True:
                self._dispatch(*conn.recv())
                if not conn.poll(0):
                    return True
        except (EOFError, OSError):
            self._gone = True
            self._engine_gone()
            return False

    def _receive(self) -> None:
        conn = self._conn
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self._dispatch(*message)
        self._gone = True
        self._engine_gone()

    def _dispatch(self, kind: str, payload) -> None:
        if kind == "stats":
            self._stats = payload
        elif kind == "stop_user":
            if self.on_stop_user is not None:
                self.on_stop_user(payload)
        elif kind == "detached":
            self._clients_left = payload
        elif kind == "fatal":
            with self._lock:
                self._exit_error = self.fatal = payload
            log.error("the engine failed: %s", payload)
        else:
            self._deliver(payload)

    def _deliver(self, outputs: list[tuple]) -> None:
        callbacks, lock, earlier = self._callbacks, self._lock, self._earlier
        middle = len(MIDDLE_FIELDS)
        for values in outputs:
            if len(values) == middle:  # the rest is as in the request's previous output
                request_id, new_ids, num_output, num_new_blocks, last_time = values
                e = earlier[request_id]
                out = RequestOutput(
                    request_id, new_ids, [], num_output, False, None, None, e.num_prompt_tokens,
                    e.num_reused_blocks, num_new_blocks, e.cum_logprob, e.arrival_time,
                    e.first_scheduled_time, e.first_token_time, last_time,
                )  # fmt: skip
            else:
                out = RequestOutput(*values)
                if out.finished:
                    earlier.pop(out.request_id, None)
                else:
                    earlier[out.request_id] = out
            with lock:
                callback = (
                    callbacks.pop(out.request_id, None)
                    if out.finished
                    else callbacks.get(out.request_id)
                )
            if callback is not None:
                try:
                    callback(out)
                except Exception:  # a caller's bug must not stop the outputs of the others
                    log.exception("output callback failed for request %s", out.request_id)

    def _engine_gone(self) -> None:
        if self._stopping:
            reason = "the engine was shut down"
        elif self.process is not None:
            code = self.process.wait()
            reason = (
                f"the engine process exited (code {code})" if code else "the engine was shut down"
            )
        else:
            reason = "the engine process exited"
        with self._lock:
            self._exit_error = self._exit_error or reason
            orphans, self._callbacks = self._callbacks, {}
            self._earlier.clear()
        for request_id, callback in orphans.items():
            callback(
                RequestOutput(
                    request_id, [], [], 0, True, FinishReason.ERROR, error=self._exit_error
                )
            )

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _take_start_lock(name: str) -> socket.socket | None:
    """The right to start the engine `name`, held while the socket is open (an abstract Unix
    socket: bound by one process at a time, freed when it closes or dies); None if taken."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(address(name) + "-starting")
    except OSError:
        sock.close()
        return None
    return sock

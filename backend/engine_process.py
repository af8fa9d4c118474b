"""The executor in a process of its own, and the handle that drives it from another process.

Why a process. A server answering the engine's outputs (the Triton model builds response
tensors and makes a send round trip per response) would otherwise hold, in the engine's own
process, the interpreter lock that the engine loop needs between steps: under load the two
took turns and the engine ran at a fraction of its speed. Apart, each has an interpreter of its
own, and they meet once per engine step. The engine may also run under another Python than its
caller: a GPU host's own torch (and numpy 2) while Triton's Python backend, whose stub reads
tensors through numpy 1.x only, runs in an environment of its own.

SIGTERM to the engine process drains it: the requests in flight end at once with the error "the
server is shutting down" (`rejected` = "shutting_down", which clients should retry elsewhere),
later submits are refused the same way, and the process waits for the handle's stop. A server
being stopped sends it first, so that Triton has no request in flight left to wait for.

Protocol: one socket pair, `multiprocessing.connection` framing, pickled tuples.

    handle -> engine   EngineConfig (first), then ("submit", id, prompt_ids, SamplingParams)
                       | ("cancel", id) | ("stop",)
    engine -> handle   ("ready", EngineInfo) | ("failed", traceback) (once, first), then
                       ("outputs", [output, ...]) | ("stats", ExecutorStats), and
                       ("fatal", message) (last) when the engine cannot compute any more

An output travels as the tuple of `RequestOutput`'s fields (a tenth of the pickling cost of the
objects); the outputs produced since the last message go together, about one message per step.
A request the engine refuses after the handle's own checks (a full queue) comes back as a
finished output with reason `error` and `rejected` set. When the engine process dies, every
request in flight ends with an error output and later submits raise. When the engine fails (a
tensor-parallel rank died), its requests end with an error output naming the cause, it sends
"fatal" with it, and exits with FATAL_EXIT_CODE; the handle is then no longer `alive` and later
submits raise that message.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from backend.config import EngineConfig
from backend.limits import EngineLimits
from backend.request import FinishReason, RequestOutput
from backend.sampling_params import SamplingParams

log = logging.getLogger(__name__)

ENGINE_PYTHON_ENV = "TRITONLLM_ENGINE_PYTHON"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
STATS_PERIOD_S = 0.1
SHUTTING_DOWN = "the server is shutting down; retry the request (on another replica)"
FATAL_EXIT_CODE = 3


@dataclass(frozen=True)
class EngineInfo:
    """What the engine tells its handle once the model is loaded."""

    model_dir: str
    vocab_size: int
    max_seq_len: int
    eos_token_ids: list[int]
    limits: EngineLimits
    device: str
    pid: int


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


# ---- the handle (caller's process) ---------------------------------------------------------------
class EngineProcess:
    """Starts an engine process and drives it like an `Executor`: `submit`, `cancel`, `stats`,
    `shutdown`. Outputs reach each request's callback from the handle's receiver thread."""

    def __init__(
        self, config: EngineConfig, python: str | None = None, start_timeout_s: float = 1800.0
    ):
        config.validate()
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p
        )
        self.process = subprocess.Popen(
            [python or engine_python(), "-m", "backend.engine_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            cwd=PROJECT_ROOT,
        )
        theirs.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._callbacks: dict[str, object] = {}
        self._stats = None
        self._exit_error: str | None = None
        self.fatal: str | None = None  # why the engine failed ("fatal"), once it has
        try:
            self._conn.send(config)
            self.info: EngineInfo = self._wait_ready(start_timeout_s)
        except BaseException:
            self._kill()
            raise
        self._receiver = threading.Thread(target=self._receive, name="engine-receiver", daemon=True)
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

    def stats(self):
        """The engine's latest statistics (it sends them every STATS_PERIOD_S)."""
        return self._stats

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine: requests in flight end as cancelled, then the process exits."""
        if self.process.poll() is None:
            try:
                self._send(("stop",))
            except OSError:
                pass
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
        self._receiver.join(timeout=timeout_s)
        self._conn.close()

    # ---- internals ----
    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if self.process.poll() is not None:
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

    def _receive(self) -> None:
        conn, callbacks, lock = self._conn, self._callbacks, self._lock
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                break
            if kind == "stats":
                self._stats = payload
                continue
            if kind == "fatal":
                with lock:
                    self._exit_error = self.fatal = payload
                log.error("the engine failed: %s", payload)
                continue
            for values in payload:
                out = RequestOutput(*values)
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
        self._engine_gone()

    def _engine_gone(self) -> None:
        code = self.process.wait()
        with self._lock:
            self._exit_error = self._exit_error or (
                f"the engine process exited (code {code})" if code else "the engine was shut down"
            )
            orphans, self._callbacks = self._callbacks, {}
        for request_id, callback in orphans.items():
            callback(
                RequestOutput(
                    request_id, [], [], 0, True, FinishReason.ERROR, error=self._exit_error
                )
            )

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# ---- the engine (its own process) ----------------------------------------------------------------
class _Outbox:
    """Outputs produced by the executor thread, sent in one message by the outbox thread; the
    statistics every STATS_PERIOD_S beside them."""

    def __init__(self, conn: Connection, executor):
        self._conn, self._executor = conn, executor
        self.rejected_reason: str | None = None  # set while draining: why requests end
        self._items: list[tuple] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def put(self, out: RequestOutput) -> None:
        """The executor's output callback (executor thread)."""
        values = (
            out.request_id,
            out.new_token_ids,
            out.new_logprobs,
            out.num_output_tokens,
            out.finished,
            out.finish_reason,
            out.error,
            out.num_prompt_tokens,
            out.num_reused_blocks,
            out.num_new_blocks,
            out.cum_logprob,
            out.arrival_time,
            out.first_scheduled_time,
            out.first_token_time,
            out.last_token_time,
            out.rejected or (self.rejected_reason if out.error else None),
            out.new_top_ids,
            out.new_top_logprobs,
            out.prompt_logprobs,
            out.prompt_top_ids,
            out.prompt_top_logprobs,
        )
        with self._cond:
            self._items.append(values)
            if len(self._items) == 1:
                self._cond.notify()

    def reject(self, request_id: str, reason: str, message: str) -> None:
        self.put(
            RequestOutput(
                request_id, [], [], 0, True, FinishReason.ERROR, error=message, rejected=reason
            )
        )

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        next_stats = 0.0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._closing, timeout=STATS_PERIOD_S)
                batch, self._items = self._items, []
                closing = self._closing
            try:
                if batch:
                    self._conn.send(("outputs", batch))
                now = time.monotonic()
                if now >= next_stats:
                    self._conn.send(("stats", self._executor.stats()))
                    next_stats = now + STATS_PERIOD_S
            except OSError:  # the handle is gone
                return
            if closing:
                return


def serve(conn: Connection) -> int:
    """The engine process: load the model, then serve the handle's messages until it stops."""
    from backend.executor import Executor, QueueFullError  # torch: only in the engine process

    config = conn.recv()
    try:
        executor = Executor(config)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return 1
    outbox = _Outbox(conn, executor)
    conn.send(
        (
            "ready",
            EngineInfo(
                executor.model_dir,
                executor.vocab_size,
                executor.max_seq_len,
                list(executor.eos_token_ids),
                executor.limits,
                str(executor.runner.device),
                os.getpid(),
            ),
        )
    )
    wake_read, wake_write = os.pipe()
    signal.signal(signal.SIGTERM, lambda signum, frame: os.write(wake_write, b"x"))
    executor.on_fatal = lambda message: os.write(wake_write, b"f")
    draining = False
    try:
        while True:
            if executor.error is not None:  # its requests have failed with it: tell and exit
                executor.shutdown()
                outbox.close()
                conn.send(("fatal", executor.error))
                return FATAL_EXIT_CODE
            if wake_read in wait([conn, wake_read]):
                os.read(wake_read, 64)
                if executor.error is None and not draining:
                    draining = True
                    outbox.rejected_reason = "shutting_down"
                    executor.shutdown(reason=SHUTTING_DOWN)
                continue
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the handle is gone: stop
                break
            kind = message[0]
            if kind == "submit" and draining:
                outbox.reject(message[1], "shutting_down", SHUTTING_DOWN)
            elif kind == "submit":
                _, request_id, prompt_ids, sampling = message
                try:
                    executor.submit(request_id, prompt_ids, sampling, outbox.put)
                except QueueFullError as exc:
                    outbox.reject(request_id, "queue_full", f"Exceeds maximum queue size: {exc}")
                except (ValueError, RuntimeError) as exc:
                    outbox.reject(request_id, "invalid", str(exc))
            elif kind == "cancel":
                executor.cancel(message[1])
            elif kind == "stop":
                break
    finally:
        executor.shutdown()
        outbox.close()
        conn.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="engine %(levelname)s %(name)s: %(message)s")
    return serve(Connection(int(argv[0])))


if __name__ == "__main__":
    # Run as `-m`, this file is `__main__`: pickled classes must name `backend.engine_process`.
    from backend.engine_process import main as engine_main

    sys.exit(engine_main())

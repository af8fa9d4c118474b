"""The engine process's side: load the executor, then serve the messages of its clients.

A client is an `EngineProcess` handle (backend/engine_process.py). The first client starts the
process and hands it one end of a socket pair; a process started with a name also listens on it
(an abstract Unix socket), so that more clients attach: several Triton instances of the LLM model,
each a stub process with an interpreter of its own, answering the requests of one engine.

Protocol: `multiprocessing.connection` framing, pickled tuples.

    client -> engine   EngineConfig (first), then ("submit", id, prompt_ids, SamplingParams)
                       | ("cancel", id) | ("stop_user", user_id) | ("stop",)
    engine -> client   ("ready", EngineInfo) | ("failed", message) (once, first), then
                       ("outputs", [output, ...]) | ("stats", ExecutorStats)
                       | ("stop_user", user_id) (another client was asked to stop a request of
                       that user id: it may be one of yours) | ("detached", clients_left) (the
                       answer to "stop", last) | ("fatal", message) (last) when the engine cannot
                       compute any more

A client that attaches sends the config it would have started the engine with; a different one
is refused. An output travels as the tuple of `RequestOutput`'s fields (a tenth of the pickling
cost of the objects), a stream's middle outputs as the few fields that change
(`output_values`); a client's outputs produced since its last message go together, about one
message per step. A request the engine refuses after the handle's own checks (a full queue)
comes back as a finished output with reason `error` and `rejected` set. A client that stops (or
whose connection closes) has its requests cancelled; the process exits when its last client has
gone. SIGTERM drains it: the requests in flight end at once with the error "the server is
shutting down" (`rejected` = "shutting_down"), later submits are refused the same way, and the
process waits for its clients' stop. When the engine fails (a tensor-parallel rank died), its
requests end with an error output naming the cause, every client gets "fatal" with it, and the
process exits with FATAL_EXIT_CODE.

Run as `python -m backend.engine_service FD [NAME]`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler

from backend.limits import EngineLimits
from backend.request import FinishReason, RequestOutput

log = logging.getLogger(__name__)

STATS_PERIOD_S = 0.1
SHUTTING_DOWN = "the server is shutting down; retry the request (on another replica)"
FATAL_EXIT_CODE = 3
HANDSHAKE_TIMEOUT_S = 10.0
ENGINE_NICE = -5  # ahead of the server's and clients' threads on a busy host, where allowed


@dataclass(frozen=True)
class EngineInfo:
    """What the engine tells each client once the model is loaded."""

    model_dir: str
    vocab_size: int
    max_seq_len: int
    eos_token_ids: list[int]
    limits: EngineLimits
    device: str
    pid: int


def address(name: str) -> str:
    """The abstract Unix socket a named engine listens on (no file: it goes with the process)."""
    return f"\0tritonllm-engine-{name}"


def output_values(out: RequestOutput, rejected_reason: str | None = None) -> tuple:
    """An output as the tuple of its fields; `rejected_reason` marks errors while draining. The
    outputs between a plain stream's first and last (no log-probs) travel as MIDDLE_FIELDS
    only: the client keeps the rest from the request's previous output (a quarter of the
    fields: the engine's step thread pickles every output of every step)."""
    if (
        not out.finished
        and not out.new_logprobs
        and out.new_top_ids is None
        and out.prompt_logprobs is None
        and out.num_output_tokens > len(out.new_token_ids)  # an output came before
    ):
        return (
            out.request_id,
            out.new_token_ids,
            out.num_output_tokens,
            out.num_new_blocks,
            out.last_token_time,
        )
    return (
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
        out.rejected or (rejected_reason if out.error else None),
        out.new_top_ids,
        out.new_top_logprobs,
        out.prompt_logprobs,
        out.prompt_top_ids,
        out.prompt_top_logprobs,
    )


# What a middle output carries (`output_values`); the rest is its request's previous output's.
MIDDLE_FIELDS = (
    "request_id",
    "new_token_ids",
    "num_output_tokens",
    "num_new_blocks",
    "last_token_time",
)


class Outbox:
    """Everything the engine sends its clients after "ready": each client's outputs of a pass of
    the executor's loop in one message, notices in order, and the statistics every
    STATS_PERIOD_S. It also knows which client each request in flight is for.

    The executor thread turns its outputs into messages and writes them itself, once per pass
    of its loop (`flush`), without waiting: a second thread doing either would hand the
    interpreter lock back and forth with the step thread several times a step, and each handoff
    costs the step more than the work. What a client's socket cannot take at once goes to the
    writer thread, which waits for the socket (the lock is released meanwhile), so a slow client
    never stalls a step; while it has anything to write, later messages queue behind it, in
    order. Messages are written with `multiprocessing.connection`'s framing, so the clients'
    `recv` reads them."""

    def __init__(self, executor):
        self._executor = executor
        self.rejected_reason: str | None = None  # set while draining: why requests end
        self._pending: deque[tuple[Connection, RequestOutput]] = deque()  # appends need no lock
        self._requests: dict[Connection, set[str]] = {}
        self._sockets: dict[Connection, socket.socket] = {}  # a socket on each one's descriptor
        self._lock = threading.Lock()  # turns outputs into messages, in order
        self._messages: deque[tuple[Connection, bytes | None]] = deque()  # framed; None: close
        self._cond = threading.Condition()
        self._writing = False  # the writer thread has messages in hand: queue behind them
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="engine-writer", daemon=True)
        self._thread.start()

    @property
    def clients(self) -> list[Connection]:
        with self._lock:
            return list(self._requests)

    def add(self, conn: Connection) -> None:
        with self._lock:
            self._requests[conn] = set()
            self._sockets[conn] = socket.socket(fileno=os.dup(conn.fileno()))

    def track(self, conn: Connection, request_id: str):
        """Note a request of `conn`; returns the executor's output callback for it."""
        with self._lock:
            self._requests[conn].add(request_id)
        pending = self._pending
        return lambda out: pending.append((conn, out))

    def flush(self) -> None:
        """Send what has been put so far (the executor calls this once per pass of its loop)."""
        if self._pending:
            with self._lock:
                self._post(self._take_pending())

    def reject(self, conn: Connection, request_id: str, reason: str, message: str) -> None:
        out = RequestOutput(
            request_id, [], [], 0, True, FinishReason.ERROR, error=message, rejected=reason
        )
        self._pending.append((conn, out))
        self.flush()

    def notify(self, conn: Connection, message: tuple) -> None:
        with self._lock:
            if conn in self._requests:
                self._post([(conn, _framed(message))])

    def remove(self, conn: Connection, farewell: tuple | None) -> set[str]:
        """Stop sending to `conn` after its outputs so far and `farewell`, then close it; returns
        its requests still in flight."""
        with self._lock:
            messages = self._take_pending()
            requests = self._requests.pop(conn, None)
            if requests is None:
                self._post(messages)
                return set()
            if farewell is not None:
                messages.append((conn, _framed(farewell)))
            self._post([*messages, (conn, None)])
            return requests

    def close(self) -> None:
        """Send what is left, then stop; the connections stay open."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _take_pending(self) -> list[tuple[Connection, bytes]]:
        """The queued outputs as one message per client (hold `_lock`)."""
        pending, reason, requests = self._pending, self.rejected_reason, self._requests
        batches: dict[Connection, list[tuple]] = {}
        while pending:
            conn, out = pending.popleft()
            ids = requests.get(conn)
            if ids is None:  # its client has gone
                continue
            batch = batches.get(conn)
            if batch is None:
                batch = batches[conn] = []
            batch.append(output_values(out, reason))
            if out.finished:
                ids.discard(out.request_id)
        return [(conn, _framed(("outputs", batch))) for conn, batch in batches.items()]

    def _post(self, messages: list[tuple[Connection, bytes | None]]) -> None:
        """Write `messages` now as far as the sockets take them; queue the rest (hold `_lock`)."""
        if not messages:
            return
        with self._cond:
            if not self._writing and not self._messages:
                messages = self._write_now(messages)
            if messages:
                self._messages.extend(messages)
                self._cond.notify()

    def _write_now(self, messages: list[tuple[Connection, bytes | None]]) -> list:
        """Write in order without waiting; returns what is left from the first message that did
        not fit (its unwritten bytes first)."""
        for i, (conn, data) in enumerate(messages):
            sock = self._sockets.get(conn)
            if data is None:
                self._close(conn)
                continue
            if sock is None:  # closed already
                continue
            try:
                sent = sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:  # that client is gone: the main loop reads its end and removes it
                continue
            if sent < len(data):
                return [(conn, data[sent:]), *messages[i + 1 :]]
        return []

    def _close(self, conn: Connection) -> None:
        sock = self._sockets.pop(conn, None)
        if sock is not None:
            sock.close()
        conn.close()

    def _run(self) -> None:
        next_stats = 0.0
        while True:
            clients = self.clients
            with self._cond:
                self._writing = False
                self._cond.wait_for(
                    lambda: self._messages or self._closing,
                    timeout=max(0.0, next_stats - time.monotonic()),
                )
                messages = list(self._messages)
                self._messages.clear()
                closing = self._closing
                stats_due = time.monotonic() >= next_stats
                self._writing = bool(messages) or stats_due
            for conn, data in messages:
                if data is None:
                    self._close(conn)
                else:
                    self._write_all(conn, data)
            if stats_due:
                stats = _framed(("stats", self._executor.stats()))
                for conn in clients:
                    self._write_all(conn, stats)
                next_stats = time.monotonic() + STATS_PERIOD_S
            if closing:
                for sock in list(self._sockets.values()):
                    sock.close()
                return

    def _write_all(self, conn: Connection, data: bytes) -> None:
        sock = self._sockets.get(conn)
        try:
            if sock is not None:
                sock.sendall(data)
        except OSError:  # that client is gone: the main loop reads its end and removes it
            pass


def _framed(message) -> bytes:
    """`message` pickled as one message of `multiprocessing.connection` (a length, the bytes),
    which the clients' `Connection.recv` reads."""
    data = ForkingPickler.dumps(message)
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!iQ", -1, len(data)) + data
    return struct.pack("!i", len(data)) + data


def _send(conn: Connection, message) -> None:
    """Send a message outside the Outbox (before it starts or after it stops)."""
    try:
        conn.send(message)
    except OSError:  # that client is gone: the main loop reads its end and removes it
        pass


def _accept(listener: socket.socket, config, info: EngineInfo | None, failed: str | None):
    """A new client: read its config, answer "ready" (or "failed"); the connection, or None."""
    sock, _ = listener.accept()
    conn = Connection(sock.detach())
    try:
        if not conn.poll(HANDSHAKE_TIMEOUT_S):
            raise EOFError
        theirs = conn.recv()
        if failed is None and theirs != config:
            failed = (
                "an engine of another configuration already runs under this name: "
                + ", ".join(
                    f"{k}={v!r} (running {getattr(config, k)!r})"
                    for k, v in vars(theirs).items()
                    if getattr(config, k, None) != v
                )
            )
        conn.send(("failed", failed) if failed else ("ready", info))
    except (EOFError, OSError):
        failed = "gone"
    if failed:
        conn.close()
        return None
    return conn


def serve(first: Connection, listener: socket.socket | None = None) -> int:
    """The engine process: load the model, then serve its clients until the last has gone."""
    from backend.executor import Executor, QueueFullError  # torch: only in the engine process

    config = first.recv()
    try:
        executor = Executor(config)
    except BaseException:
        message = traceback.format_exc()
        first.send(("failed", message))
        while listener is not None and wait([listener], timeout=0):  # clients that came meanwhile
            _accept(listener, config, None, message)
        return 1
    info = EngineInfo(
        executor.model_dir,
        executor.vocab_size,
        executor.max_seq_len,
        list(executor.eos_token_ids),
        executor.limits,
        str(executor.runner.device),
        os.getpid(),
    )
    first.send(("ready", info))
    outbox = Outbox(executor)
    executor.on_delivered = outbox.flush
    outbox.add(first)
    wake_read, wake_write = os.pipe()
    signal.signal(signal.SIGTERM, lambda signum, frame: os.write(wake_write, b"x"))
    executor.on_fatal = lambda message: os.write(wake_write, b"f")
    draining = False

    def detach(conn: Connection, farewell_left: bool) -> None:
        left = len(outbox.clients) - 1
        for request_id in outbox.remove(conn, ("detached", left) if farewell_left else None):
            executor.cancel(request_id)

    try:
        while outbox.clients:
            if executor.error is not None:  # its requests have failed with it: tell and exit
                executor.shutdown()
                clients = outbox.clients
                outbox.close()
                for conn in clients:
                    _send(conn, ("fatal", executor.error))
                return FATAL_EXIT_CODE
            sources = [*outbox.clients, wake_read] + ([listener] if listener else [])
            for ready in wait(sources):
                if ready is wake_read:
                    os.read(wake_read, 64)
                    if executor.error is None and not draining:
                        draining = True
                        outbox.rejected_reason = "shutting_down"
                        executor.shutdown(reason=SHUTTING_DOWN)
                elif ready is listener:
                    conn = _accept(listener, config, info, None)
                    if conn is not None:
                        outbox.add(conn)
                else:
                    try:
                        message = ready.recv()
                    except (EOFError, OSError):  # the client is gone
                        detach(ready, farewell_left=False)
                        continue
                    _handle(message, ready, executor, outbox, draining, QueueFullError, detach)
    finally:
        if listener is not None:
            listener.close()
        executor.shutdown()
        outbox.close()
    return 0


def _handle(message, conn, executor, outbox, draining, queue_full, detach) -> None:
    kind = message[0]
    if kind == "submit" and draining:
        outbox.reject(conn, message[1], "shutting_down", SHUTTING_DOWN)
    elif kind == "submit":
        _, request_id, prompt_ids, sampling = message
        try:
            executor.submit(request_id, prompt_ids, sampling, outbox.track(conn, request_id))
        except queue_full as exc:
            outbox.reject(conn, request_id, "queue_full", f"Exceeds maximum queue size: {exc}")
        except (ValueError, RuntimeError) as exc:
            outbox.reject(conn, request_id, "invalid", str(exc))
    elif kind == "cancel":
        executor.cancel(message[1])
    elif kind == "stop_user":
        for other in outbox.clients:
            if other is not conn:
                outbox.notify(other, message)
    elif kind == "stop":
        detach(conn, farewell_left=True)


def listen(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(address(name))
    sock.listen(64)
    return sock


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="engine %(levelname)s %(name)s: %(message)s")
    first = Connection(int(argv[0]))
    try:  # the step loop paces every stream: on a host whose cores are busy it goes first
        os.setpriority(os.PRIO_PROCESS, 0, ENGINE_NICE)
    except OSError:  # raising a priority needs CAP_SYS_NICE: run at the normal one
        pass
    try:
        listener = listen(argv[1]) if len(argv) > 1 else None
    except OSError as exc:
        first.recv()
        first.send(("failed", f"cannot listen as engine {argv[1]!r}: {exc}"))
        return 1
    return serve(first, listener)


if __name__ == "__main__":
    # Run as `-m`, this file is `__main__`: pickled classes must name `backend.engine_service`.
    from backend.engine_service import main as engine_main

    sys.exit(engine_main())

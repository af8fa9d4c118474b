"""The engine process's side: load the executor, then serve the messages of its clients.

A client is an `EngineProcess` handle (backend/process/client.py). The first client starts the
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

A client that attaches sends the config it would have started the engine with; a different one is
refused. An output travels as the tuple of `RequestOutput`'s fields (a tenth of the pickling cost of
the objects), a stream's middle outputs as the few fields that change (`backend.process.outbox`); a
client's outputs produced since its last message go together, about one message per step. A request
the engine refuses after the handle's own checks (a full queue) comes back as a finished output with
reason `error` and `rejected` set. A client that stops (or whose connection closes) has its requests
cancelled; the process exits when its last client has gone. SIGTERM drains it: the requests in
flight end at once with the error "the server is shutting down" (`rejected` = "shutting_down"),
later submits are refused the same way, and the process waits for its clients' stop. When the engine
fails (a tensor-parallel rank died), its requests end with an error output naming the cause, every
client gets "fatal" with it, and the process exits with FATAL_EXIT_CODE.

Run as `python -m backend.process.service FD [NAME]`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from backend.engine.limits import EngineLimits
from backend.process.outbox import Outbox

log = logging.getLogger(__name__)

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
    from backend.engine.executor import (
        Executor,
        QueueFullError,
    )  # torch: only in the engine process

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
    # Run as `-m`, this file is `__main__`: pickled classes must name `backend.process.service`.
    from backend.process.service import main as engine_main

    sys.exit(engine_main())

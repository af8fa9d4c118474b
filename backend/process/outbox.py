"""What the engine process sends its clients after "ready": each pass's outputs, notices and
statistics (`Outbox`), in `multiprocessing.connection`'s framing, and the tuple an output
travels as (`output_values`; a stream's middle outputs as MIDDLE_FIELDS only). The protocol:
`backend.process.service`."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from backend.request import FinishReason, RequestOutput

STATS_PERIOD_S = 0.1


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
        out.num_draft_tokens,
        out.num_accepted_draft_tokens,
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

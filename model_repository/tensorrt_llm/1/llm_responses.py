"""Live Triton requests of the LLM model and the thread that answers them.

One thread reads the engine's outputs (the handle's `pump`, so no receiver thread takes turns
with it at the interpreter lock), builds the responses and sends them, so each request's
responses leave in order; while it sends, the outputs that arrive wait in the socket. A send
is a round trip to the server (and, through the ensemble, the scheduling of the next step), so
under load outputs wait: a row's outputs that wait together go out as one response (fewer round
trips, the same text), and the sender answers rows that finished first, then rows that have
had no response yet, then the one waiting longest. A finished request frees its client for the
next request at once, and time to first token does not wait for every stream's next piece.
Every request ends with the FINAL flag: after its last row finishes, errors and cancellations
included. A model that is not decoupled answers each request once, when its last row finishes,
with every row in one batch (or the first error).

A request is polled for cancellation only while its FINAL response has not been sent: the final
send releases the request's response factory in the server, and asking a released factory
whether it was cancelled crashed tritonserver 2.51 (SIGSEGV in
TRITONBACKEND_ResponseFactoryIsCancelled, seen once under 32 concurrent streams). The poll and the
final send take the request's lock, so they never overlap; a request refused at submit is closed
before its caller sends the error. Each poll is a round trip too: at most CANCEL_CHECKS_PER_S of
them a second, in turn over the live requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.request import FinishReason, RequestOutput
from ensemble.request_loop import triton_error

from llm_inputs import RowRequest
from llm_metrics import FinishedRequest, LlmMetrics
from llm_outputs import RowStream, stack_rows

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Why the engine refused a request (RequestOutput.rejected) -> the Triton error code.
ERROR_CODES = {
    "queue_full": "UNAVAILABLE",
    "shutting_down": "UNAVAILABLE",
    "invalid": "INVALID_ARG",
}
CANCEL_CHECKS_PER_S = 1000
IDLE_WAKE_S = 0.1  # the response thread looks for a shutdown this often while idle


@dataclass
class LiveRequest:
    """One Triton request: its sender and how many of its rows are still running."""

    request: object  # the pb_utils.InferenceRequest, polled for cancellation
    sender: object
    user_id: str
    requested: frozenset[str]  # empty = every output
    engine_ids: list[str] = field(default_factory=list)
    pending: int = 0
    closed: bool = False  # its FINAL response was sent
    # not decoupled: each finished row's tensors (by batch row), the first failure (message, code)
    finished_rows: dict[int, dict] = field(default_factory=dict)
    error: tuple[str, str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # a cancellation poll vs FINAL


@dataclass
class LiveRow:
    request: LiveRequest
    stream: RowStream
    num_prompt_tokens: int
    last_sent: float = 0.0  # time.monotonic() of its last response


class ResponseDispatcher:
    def __init__(
        self,
        engine,
        metrics: LlmMetrics | None,
        decoupled: bool = True,
        gap_per_row_s: float = 0.0,
    ):
        self._engine = engine
        # A row's next response waits for this times the live rows since its last one
        self._gap_per_row_s = gap_per_row_s
        self._metrics = metrics
        self._decoupled = decoupled
        self._arrivals: list[RequestOutput] = []  # filled by the engine handle's callbacks
        self._stopping = threading.Event()
        self._rows: dict[str, LiveRow] = {}
        self._requests: dict[int, LiveRequest] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._prefix = f"llm-{uuid.uuid4().hex[:8]}-"  # engine ids never look like users'
        self._poll_turn = 0
        self._thread = threading.Thread(target=self._run, name="llm-responses", daemon=True)
        self._thread.start()

    # ---- from execute() ------------------------------------------------------------------------
    def submit(self, request, sender, rows: list[RowRequest]) -> None:
        """Queue every row in the engine. Raises ValueError (bad input) or RuntimeError (no engine)
        when no row was queued."""
        number = next(self._ids)
        live = LiveRequest(
            request,
            sender,
            request.request_id(),
            frozenset(request.requested_output_names()),
            pending=len(rows),
        )
        entries = []
        for i, row in enumerate(rows):
            engine_id = f"{self._prefix}{number}.{i}"
            stream = RowStream.start(
                engine_id,
                row.batch_index,
                row.streaming,
                row.prompt_ids,
                echo_prompt=not row.exclude_input_in_output,
                log_probs=row.sampling.return_log_probs,
                perf_metrics=row.return_perf_metrics,
                num_top=row.sampling.num_top_log_probs,
            )
            entries.append((engine_id, row, LiveRow(live, stream, len(row.prompt_ids))))
        with self._lock:
            for engine_id, _, entry in entries:
                self._rows[engine_id] = entry
                live.engine_ids.append(engine_id)
            self._requests[id(live)] = live
        submitted = []
        try:
            for engine_id, row, _ in entries:
                self._engine.submit(engine_id, row.prompt_ids, row.sampling, self._arrived)
                submitted.append(engine_id)
        except (ValueError, RuntimeError) as exc:
            with self._lock:
                live.pending = len(submitted)  # the cancelled rows still end normally
                for engine_id, _, _ in entries[len(submitted) :]:
                    self._rows.pop(engine_id, None)
                    live.engine_ids.remove(engine_id)
                if not submitted:
                    self._requests.pop(id(live), None)
            if not submitted:
                with live.lock:  # the caller sends the FINAL error: no poll may follow it
                    live.closed = True
                raise
            # Some rows run already: report the error now, their ends carry the FINAL flag.
            if self._decoupled:
                self._send(
                    live, pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), 0
                )
            else:
                live.error = (
                    str(exc),
                    "INVALID_ARG" if isinstance(exc, ValueError) else "INTERNAL",
                )
            for engine_id in submitted:
                self._engine.cancel(engine_id)

    def stop(self, request_id: str) -> int:
        """The `stop` input: cancel every row of the live requests with this request id, or the
        engine request of this id (`llm_request_id` output)."""
        with self._lock:
            if request_id in self._rows:
                ids = [request_id]
            else:
                ids = [
                    e
                    for r in self._requests.values()
                    if r.user_id == request_id
                    for e in r.engine_ids
                ]
        return sum(self._engine.cancel(engine_id) for engine_id in ids)

    # ---- from the poll thread ------------------------------------------------------------------
    def poll_cancellations(self, period_s: float) -> None:
        """Cancel the engine requests of Triton requests whose client went away: the next share
        of the live requests, as many as CANCEL_CHECKS_PER_S allows in `period_s`."""
        with self._lock:
            live = list(self._requests.values())
        if not live:
            return
        budget = max(1, int(CANCEL_CHECKS_PER_S * period_s))
        start = self._poll_turn % len(live)
        self._poll_turn = start + budget
        for request in (live[(start + i) % len(live)] for i in range(min(budget, len(live)))):
            with request.lock:
                if request.closed:
                    continue
                try:
                    cancelled = request.request.is_cancelled()
                except Exception:  # the sender is already closed
                    continue
            if cancelled:
                for engine_id in request.engine_ids:
                    self._engine.cancel(engine_id)

    def num_live(self) -> int:
        with self._lock:
            return len(self._requests)

    def shutdown(self) -> None:
        """Stop the response thread (before the engine handle's shutdown, which then reads the
        rest of the engine's messages itself)."""
        self._stopping.set()
        self._thread.join(timeout=10)

    # ---- the response thread -------------------------------------------------------------------
    def _run(self) -> None:
        """Answer outputs, each row's in order, urgent rows first (see the module docstring)."""
        waiting: dict[str, RequestOutput] = {}  # row -> its newest unanswered output, oldest first
        urgent: dict[str, None] = {}  # waiting rows finished or not answered yet, a set in order
        due_in: float | None = None  # until the oldest waiting row may be answered again
        while not self._stopping.is_set():
            block = not waiting or due_in is not None
            timeout = min(due_in or IDLE_WAKE_S, IDLE_WAKE_S) if block else 0.0
            if not self._engine.pump(timeout) and block and not self._arrivals:
                self._stopping.wait(timeout)  # the engine has gone: nothing more will arrive
            arrivals, self._arrivals = self._arrivals, []
            for out in arrivals:
                older = waiting.get(out.request_id)
                if older is not None:
                    self._answer(older, send=False)  # its tokens ride with the newer output
                if out.finished or self._unanswered(out.request_id):
                    urgent[out.request_id] = None
                waiting[out.request_id] = out
            if urgent:
                row = next(iter(urgent))
            else:
                row = next(iter(waiting), None)
                due_in = self._due_in(row) if row is not None else None
                if row is None or due_in > 0:
                    continue
            due_in = None
            urgent.pop(row, None)
            self._answer(waiting.pop(row))

    def _arrived(self, out: RequestOutput) -> None:
        """The engine handle's output callback (it runs in the response thread's `pump`)."""
        self._arrivals.append(out)

    def _due_in(self, row_id: str) -> float:
        """Seconds until a row's next response may go: responses of a row keep a gap that grows
        with the live rows, so that under load each carries more tokens (fewer round trips here
        and downstream); a row's first and last responses never wait."""
        row = self._rows.get(row_id)
        if row is None or not self._gap_per_row_s:
            return 0.0
        return row.last_sent + self._gap_per_row_s * len(self._rows) - time.monotonic()

    def _unanswered(self, row_id: str) -> bool:
        row = self._rows.get(row_id)
        return row is not None and row.stream.num_sent == 0

    def _answer(self, out: RequestOutput, send: bool = True) -> None:
        try:
            self.handle(out, send)
        except Exception:
            log.exception("failed to answer engine request %s", out.request_id)

    def handle(self, out: RequestOutput, answer: bool = True) -> None:
        with self._lock:
            row = self._rows.get(out.request_id)
            if row is None:
                return
            live = row.request
            if out.finished:
                self._rows.pop(out.request_id, None)
                live.pending -= 1
                if live.pending == 0:
                    self._requests.pop(id(live), None)
            last = out.finished and live.pending == 0
        stream = row.stream
        stream.add(out)
        if not answer:
            return
        if self._decoupled:
            self._answer_row(live, row, out, FINAL if last else 0)
            row.last_sent = time.monotonic()
        else:
            self._answer_whole(live, row, out, last)
        if out.finished and self._metrics is not None:
            self._metrics.record_finished(
                FinishedRequest(
                    num_input_tokens=row.num_prompt_tokens,
                    num_output_tokens=stream.num_generated,
                    finish_reason=out.finish_reason.value if out.finish_reason else "error",
                    arrival_time=out.arrival_time,
                    first_token_time=out.first_token_time,
                    last_token_time=out.last_token_time,
                    end_time=time.time(),
                    rejected=out.rejected,
                )
            )

    def _answer_row(self, live: LiveRequest, row: LiveRow, out: RequestOutput, flags: int) -> None:
        if out.finish_reason == FinishReason.ERROR or out.rejected:
            code = ERROR_CODES.get(out.rejected, "INTERNAL")
            error = triton_error(out.error or "generation failed", code)
            self._send(live, pb_utils.InferenceResponse(error=error), flags)
        elif row.stream.ready(out):
            self._send(live, self._response(row, out), flags)
        elif flags & FINAL:
            self._send(live, None, flags)

    def _answer_whole(
        self, live: LiveRequest, row: LiveRow, out: RequestOutput, last: bool
    ) -> None:
        """Not decoupled: keep each finished row; after the last, send one response with all."""
        if out.finish_reason == FinishReason.ERROR or out.rejected:
            live.error = live.error or (
                out.error or "generation failed",
                ERROR_CODES.get(out.rejected, "INTERNAL"),
            )
        elif out.finished:
            live.finished_rows[row.stream.batch_index] = row.stream.take(out)
        if not last:
            return
        if live.error is not None:
            self._send(live, pb_utils.InferenceResponse(error=triton_error(*live.error)), FINAL)
            return
        tensors = stack_rows([live.finished_rows[i] for i in sorted(live.finished_rows)])
        self._send(
            live,
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(name, value)
                    for name, value in tensors.items()
                    if not live.requested or name in live.requested
                ]
            ),
            FINAL,
        )

    @staticmethod
    def _response(row: LiveRow, out: RequestOutput):
        requested = row.request.requested
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor(name, value[np.newaxis, ...])
                for name, value in row.stream.take(out).items()
                if not requested or name in requested
            ]
        )

    def _send(self, live: LiveRequest, response, flags: int) -> None:
        if flags & FINAL:
            with live.lock:
                live.closed = True
                self._send_now(live, response, flags)
        else:
            self._send_now(live, response, flags)

    @staticmethod
    def _send_now(live: LiveRequest, response, flags: int) -> None:
        try:
            if response is None:
                live.sender.send(flags=flags)
            else:
                live.sender.send(response, flags=flags)
        except Exception as exc:  # the client is gone; nothing else to do for it
            log.info("could not send a response for request %r: %s", live.user_id, exc)

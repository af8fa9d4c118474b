"""From sampled tokens to outputs: append, stop checks, hold-back, delivery.

Runs on the executor thread, once per sampling request per step, so it is written for that rate:
each request's end ids are resolved once at submission, a request without stop sequences skips
suffix matching, and the delivered-token counter is handed to the executor's stats in bulk instead
of taking the lock for every output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from backend.request import FinishReason, Request, RequestOutput, RequestStatus
from backend.stopping import check_finish

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]
ReleaseHook = Callable[[Request, FinishReason, "str | None"], None]


class LiveRequest:
    """Delivery state of one request, beside the engine-side Request."""

    __slots__ = ("request", "callback", "end_ids", "num_delivered", "cum_logprob")

    def __init__(self, request: Request, callback: OutputCallback, end_ids: frozenset[int]):
        self.request = request
        self.callback = callback
        self.end_ids = end_ids
        self.num_delivered = 0
        self.cum_logprob = 0.0


class OutputProcessor:
    def __init__(self, max_seq_len: int, default_end_ids: list[int], release: ReleaseHook):
        """`release(request, reason, error)` is called once when a request ends, before its final
        output is delivered: the executor frees its blocks, forgets it and counts it there."""
        self.max_seq_len = max_seq_len
        self.default_end_ids = frozenset(default_end_ids)
        self.live: dict[str, LiveRequest] = {}
        self.num_unflushed_tokens = 0  # delivered, not yet added to the executor's stats
        self._release = release

    def add(self, request: Request, callback: OutputCallback) -> None:
        end_id = request.sampling.end_id
        end_ids = self.default_end_ids if end_id is None else frozenset((end_id,))
        self.live[request.request_id] = LiveRequest(request, callback, end_ids)

    def append(self, request: Request, token: int, logprob: float, now: float) -> None:
        """A sampled token arrived: record it, check stops, deliver what may be delivered."""
        live = self.live.get(request.request_id)
        if live is None or request.status is RequestStatus.FINISHED:
            return  # ended meanwhile: the token is discarded
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        reason, deliverable = check_finish(request, live.end_ids, self.max_seq_len)
        self._deliver(live, deliverable, reason)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request early (cancel, error): deliver what is held back, then the final flag."""
        live = self.live.get(request.request_id)
        if live is None or request.status is RequestStatus.FINISHED:
            return
        self._deliver(
            live,
            len(request.output_ids) if reason != FinishReason.ERROR else live.num_delivered,
            reason,
            error,
        )

    def _deliver(
        self,
        live: LiveRequest,
        deliverable: int,
        reason: FinishReason | None,
        error: str | None = None,
    ) -> None:
        request = live.request
        start = live.num_delivered
        if deliverable < start:
            deliverable = start
        finished = reason is not None
        if deliverable == start and not finished:
            return
        new_ids = request.output_ids[start:deliverable]
        new_logprobs = (
            request.output_logprobs[start:deliverable] if request.sampling.return_log_probs else []
        )
        live.num_delivered = deliverable
        if new_logprobs:
            live.cum_logprob += sum(new_logprobs)
        self.num_unflushed_tokens += deliverable - start
        if finished:
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            request.error = error
            self._release(request, reason, error)
        # Positional, in RequestOutput's field order: three times cheaper than keywords, and this
        # runs for every request every step.
        out = RequestOutput(
            request.request_id,
            new_ids,
            new_logprobs,  # id, new tokens
            deliverable,
            finished,
            reason,
            error,  # progress, end
            len(request.prompt_ids),
            request.num_reused_blocks,
            request.num_new_blocks,
            live.cum_logprob,
            request.arrival_time,
            request.first_scheduled_time,
            request.first_token_time,
            request.last_token_time,
        )
        try:
            live.callback(out)
        except Exception:
            log.exception("on_output callback failed for request %s", request.request_id)
            if not finished:
                self.finish(request, FinishReason.ERROR, error="the output callback failed")

"""From sampled tokens to outputs: append, stop checks, hold-back, delivery.

Runs on the executor thread, once per sampling request per step, so it is written for that rate:
each request's end ids are resolved once at submission, a request without stop sequences skips
suffix matching, and the delivered-token counter is handed to the executor's stats in bulk instead
of taking the lock for every output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from backend.engine.stopping import check_finish
from backend.request import FinishReason, Request, RequestOutput, RequestStatus

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]
ReleaseHook = Callable[[Request, FinishReason, "str | None"], None]


class LiveRequest:
    """Delivery state of one request, beside the engine-side Request."""

    __slots__ = ("request", "callback", "end_ids", "num_delivered", "cum_logprob", "prompt_due")

    def __init__(self, request: Request, callback: OutputCallback, end_ids: frozenset[int]):
        self.request = request
        self.callback = callback
        self.end_ids = end_ids
        self.num_delivered = 0
        self.cum_logprob = 0.0
        self.prompt_due = request.prompt_logprobs is not None  # sent with the first output


class OutputProcessor:
    def __init__(
        self,
        max_seq_len: int,
        default_end_ids: list[int],
        release: ReleaseHook,
        stream_interval: int = 1,
    ):
        """`release(request, reason, error)` is called once when a request ends, before its final
        output is delivered: the executor frees its blocks, forgets it and counts it there.
        `stream_interval`: a request's outputs between its first and its last wait until they
        carry that many new tokens (fewer outputs, the same tokens)."""
        self.max_seq_len = max_seq_len
        self.stream_interval = stream_interval
        self.default_end_ids = frozenset(default_end_ids)
        self.live: dict[str, LiveRequest] = {}
        self.num_unflushed_tokens = 0  # delivered, not yet added to the executor's stats
        self._release = release

    def add(self, request: Request, callback: OutputCallback) -> None:
        end_id = request.sampling.end_id
        end_ids = self.default_end_ids if end_id is None else frozenset((end_id,))
        self.live[request.request_id] = LiveRequest(request, callback, end_ids)

    def append(
        self,
        request: Request,
        token: int,
        logprob: float,
        now: float,
        top: tuple[list[int], list[float]] | None = None,
    ) -> None:
        """A sampled token arrived: record it, check stops, deliver what may be delivered.
        `top`: its position's top-k ids and log-probs, when the step computed them (at the
        largest k of the batch: cut to the request's own)."""
        live = self.live.get(request.request_id)
        if live is None or request.status is RequestStatus.FINISHED:
            return  # ended meanwhile: the token is discarded
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        if top is not None:
            k = request.sampling.num_top_log_probs
            if k:
                request.output_top_ids.append(top[0][:k])
                request.output_top_logprobs.append(top[1][:k])
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        reason, deliverable = check_finish(request, live.end_ids, self.max_seq_len)
        self._deliver(live, deliverable, reason)

    def append_run(self, request: Request, tokens: list[int], now: float) -> None:
        """Several tokens of one step (verified drafts and the target's token after them), in
        order: each is checked for stops as if it came alone, those after a stop are dropped,
        and what may be delivered goes in one output. No log-probs (never asked of a speculated
        request)."""
        live = self.live.get(request.request_id)
        if live is None or request.status is RequestStatus.FINISHED:
            return
        for token in tokens:
            request.output_ids.append(token)
            request.output_logprobs.append(0.0)
            reason, deliverable = check_finish(request, live.end_ids, self.max_seq_len)
            if reason is not None:
                break
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
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
        if not finished and (
            deliverable == start or (start and deliverable - start < self.stream_interval)
        ):
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
        top_ids = top_logprobs = None
        if request.sampling.num_top_log_probs:
            top_ids = request.output_top_ids[start:deliverable]
            top_logprobs = request.output_top_logprobs[start:deliverable]
        prompt = None, None, None
        if live.prompt_due:
            live.prompt_due = False
            if request.prompt_logprobs.complete:
                prompt = request.prompt_logprobs.result()
            request.prompt_logprobs.pieces = []  # delivered (or never will be): drop the tensors
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
            None,  # not rejected
            top_ids,
            top_logprobs,
            *prompt,
            request.num_draft_tokens,
            request.num_accepted_draft_tokens,
        )
        try:
            live.callback(out)
        except Exception:
            log.exception("on_output callback failed for request %s", request.request_id)
            if not finished:
                self.finish(request, FinishReason.ERROR, error="the output callback failed")

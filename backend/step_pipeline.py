"""Running scheduled steps: forward pass, sampling, and handing the sampled ids to the outputs.

Two ways, same tokens:

- synchronous: run step n, wait for its ids, process them, then schedule step n+1. The host's
  work (processing, scheduling, packing) runs while the device idles.
- overlapped (`EngineConfig.overlap_scheduling`): step n is queued on the device *before* step
  n-1's ids are processed, so that work hides behind step n's forward pass.

Overlap in detail. When step n is scheduled, step n-1's sampled ids are still on the device. Each
sampling request of n-1 then holds a placeholder as its last output id (`Request.token_in_flight`):
it counts as a token, so the scheduler gives the request its next decode, and the runner fills the
placeholder's input slot on the device from n-1's id tensor (`SequenceChunk.prev_row`). Once step
n is queued, n-1's ids reach the host (pinned copy + event), replace the placeholders and go
through stop checks and delivery. A request that ended at n-1 was already queued in n: its step-n
token is discarded, never delivered, and its blocks are freed at once (the device runs the steps
in order, so no later step can overwrite them before step n is done with them). Only then is step
n completed on the host (computed counts, prefix-cache hashes, which need real token ids) and its
placeholders appended. A request whose max_tokens is reached by its in-flight token is not
scheduled again (the scheduler sees it has all its tokens).

The pipeline is drained (step n-1 fully processed before step n is packed) when a request of step n
reads its token history on the host to be sampled (penalties, bad words), when the
scheduler preempted (a preempted request must come back with real tokens), and when queueing a
step fails (then step n runs synchronously, each request alone if need be).
"""
from __future__ import annotations

import logging
import threading
import time

from backend.model_runner import ModelRunner, SequenceChunk
from backend.output_processor import OutputProcessor
from backend.request import FinishReason, Request
from backend.sampler import PendingSample, Sampler
from backend.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

log = logging.getLogger(__name__)
PLACEHOLDER = -1     # output id whose value is still on the device (never delivered, never read)
STEP_FAILED = "the model step failed for this request"


def needs_token_history(request: Request) -> bool:
    """Whether sampling this request's next token reads its output ids on the host. The
    min-tokens end ban reads only how many there are, which placeholders count right."""
    p = request.sampling
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or p.bad_token_ids)


class _InFlight:
    """A queued step whose sampled ids are on their way to the host."""

    __slots__ = ("requests", "pending", "rows")

    def __init__(self, requests: list[Request], pending: PendingSample):
        self.requests = requests                 # its sampling requests, in row order
        self.pending = pending
        self.rows = {r.request_id: i for i, r in enumerate(requests)}


class StepPipeline:
    def __init__(self, runner: ModelRunner, sampler: Sampler, scheduler: Scheduler,
                 outputs: OutputProcessor, lock: threading.Lock, overlap: bool):
        """`lock` guards the scheduler (the executor's lock); everything else here runs on the
        executor thread only."""
        self.runner = runner
        self.sampler = sampler
        self.scheduler = scheduler
        self.outputs = outputs
        self.overlap = overlap
        self._lock = lock
        self._inflight: _InFlight | None = None
        # Ids of requests that may need their history on the host (kept by the executor, under
        # `lock`): when empty, as usual, no step has to look for them.
        self.history_requests: set[str] = set()

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def run(self, output: SchedulerOutput) -> None:
        """Run one scheduled step (with overlap: queue it, and finish the previous one)."""
        if self.overlap:
            self._overlapped_step(output)
        else:
            self._step(output)

    def drain(self) -> None:
        """Finish the step in flight, if any."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self._complete(inflight)

    # ---- overlapped ----------------------------------------------------------------------------
    def _overlapped_step(self, output: SchedulerOutput) -> None:
        if self._inflight is not None and (output.preempted or self._needs_history(output)):
            self._drain_before(output)
            if not output.chunks:
                return
        previous, self._inflight = self._inflight, None
        try:
            launched = self._launch(output, previous)
        except Exception:
            log.exception("batched step failed; finishing the previous step and isolating requests")
            if previous is not None:
                self._inflight = previous
                self._drain_before(output)
            if output.chunks:
                self._step(output)
            return
        if previous is not None:
            self._complete(previous)
        with self._lock:        # after step n-1's ids are real: complete_step hashes full blocks
            self.scheduler.complete_step(output)
        for request in launched.requests:
            if not request.is_finished:
                request.output_ids.append(PLACEHOLDER)
                request.output_logprobs.append(0.0)
                request.token_in_flight = True
        self._inflight = launched if launched.requests else None

    def _drain_before(self, output: SchedulerOutput) -> None:
        """Finish the step in flight before `output` is packed; drop chunks of requests that
        ended with it."""
        self.drain()
        output.chunks = [c for c in output.chunks if not c.request.is_finished]

    def _launch(self, output: SchedulerOutput, previous: _InFlight | None) -> _InFlight:
        """Queue the forward pass and the sampling of one step; nothing waits for the device."""
        rows = previous.rows if previous is not None else {}
        chunks = []
        for c in output.chunks:
            r = c.request
            chunks.append(SequenceChunk(r.tokens(c.start, c.start + c.num_tokens), c.start, r.block_ids,
                                        c.samples, rows[r.request_id] if r.token_in_flight else -1))
        requests = [c.request for c in output.chunks if c.samples]
        bans = self.sampler.end_bans(requests)
        if previous is not None:
            step = self.runner.execute(chunks, prev_sampled=previous.pending.token_ids, banned_ids=bans)
        else:
            step = self.runner.execute(chunks, banned_ids=bans)
        if not requests:
            return _InFlight(requests, None)
        return _InFlight(requests, self.sampler.sample_async(step.logits, requests, step.argmax_ids,
                                                                   step.argmax_host))

    def _complete(self, inflight: _InFlight) -> None:
        """Wait for an in-flight step's sampled ids and process them (stops, delivery)."""
        try:
            sampled = inflight.pending.result()
        except Exception:
            log.exception("the step failed on the device")
            for request in inflight.requests:
                self.outputs.finish(request, FinishReason.ERROR, error=STEP_FAILED)
            return
        logprobs = sampled.logprobs or [0.0] * len(inflight.requests)
        self._process(inflight.requests, list(zip(sampled.token_ids, logprobs)))

    def _needs_history(self, output: SchedulerOutput) -> bool:
        """Whether a sampling request of this step reads its output ids on the host: then its
        last token must be real, not a placeholder."""
        history = self.history_requests
        if not history:
            return False
        return any(c.samples and c.request.request_id in history and needs_token_history(c.request)
                   for c in output.chunks)

    # ---- synchronous ---------------------------------------------------------------------------
    def _step(self, output: SchedulerOutput) -> None:
        sampling_chunks = [c for c in output.chunks if c.samples]
        results = self._forward_and_sample(output.chunks)
        with self._lock:
            self.scheduler.complete_step(output)
        self._process([c.request for c in sampling_chunks], results)

    def _forward_and_sample(self, chunks: list[ScheduledChunk]) -> list[tuple[int, float] | None]:
        """One entry per sampling chunk. If the batch fails, each request runs alone so that a bad
        request fails alone (re-running rewrites the same KV values)."""
        try:
            return self._run(chunks)
        except Exception:
            log.exception("batched step failed; isolating requests")
        results: list[tuple[int, float] | None] = []
        for chunk in chunks:
            try:
                results += self._run([chunk])
            except Exception:
                log.exception("request %s failed in the model step", chunk.request.request_id)
                if chunk.samples:
                    results.append(None)
        return results

    def _run(self, chunks: list[ScheduledChunk]) -> list[tuple[int, float]]:
        seq_chunks = [SequenceChunk(c.request.tokens(c.start, c.start + c.num_tokens), c.start,
                                    c.request.block_ids, c.samples) for c in chunks]
        requests = [c.request for c in chunks if c.samples]
        step = self.runner.execute(seq_chunks, banned_ids=self.sampler.end_bans(requests))
        if not requests:
            return []
        sampled = self.sampler.sample(step.logits, requests, step.argmax_ids, step.argmax_host)
        logprobs = sampled.logprobs or [0.0] * len(requests)
        return list(zip(sampled.token_ids, logprobs))

    # ---- both ----------------------------------------------------------------------------------
    def _process(self, requests: list[Request], results: list[tuple[int, float] | None]) -> None:
        """Append each request's sampled token, check stops and deliver."""
        now = time.time()
        append = self.outputs.append
        for request, result in zip(requests, results):
            if result is None:
                self.outputs.finish(request, FinishReason.ERROR, error=STEP_FAILED)
                continue
            try:
                append(request, result[0], result[1], now)
            except Exception as exc:  # a faulty callback or bookkeeping bug: this request alone
                log.exception("request %s failed", request.request_id)
                self.outputs.finish(request, FinishReason.ERROR, error=f"internal error: {exc}")

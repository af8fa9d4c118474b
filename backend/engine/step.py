"""One engine step: schedule -> run the model and sample -> process the sampled tokens.

`Engine.step` is the whole step, top to bottom; the executor's thread calls it while there is work.

Overlap scheduling (`EngineConfig.overlap_scheduling`, on by default on GPU) moves one thing: the
tokens step n samples are processed (appended, stop checks, delivery) in step n+1, once n+1 is
queued on the device, so the host's work hides behind the device's. Until then such a token is
*in flight*, and that is one field, `Request.in_flight_row`: the token's row in the sampled ids of
the step in flight (None: no token in flight).

- It counts in `Request.num_tokens`, so the scheduler gives the request its next decode without
  knowing the value (and none after it when it is the request's last, max_tokens-th, token).
- It is in no id list: `output_ids` holds real tokens only, so nothing can deliver, hash or
  penalise a value that is not there.
- The runner takes that decode's input id from the row, on the device (in a decode CUDA graph,
  the graph's first kernel does).
- Finishing the step clears the row and appends the real token.

Speculative decoding (`EngineConfig.speculative_method`) turns overlap off: before each step the
proposer drafts tokens to follow each eligible request's newest token (`_propose_drafts`), which
must therefore be on the host; the step verifies them (`_finish_verified`).

Why a count with a row (vLLM's AsyncScheduler placeholders) rather than mini-sglang's device-side
token table: only one token per request is ever unknown, while the host needs every id anyway
(stop checks, prefix hashes, delivery); a table would move all ids, and every prefill's input
packing, to the device for that one token.

The step in flight is finished before the next one is packed (a drain) when nothing else was
scheduled, when the next step preempted (a preempted request comes back with real tokens), when
one of its requests reads its token history on the host to be sampled (penalties, bad words), and
when the batch fails (then each of its requests runs alone, so that a bad one fails alone). A
request that ended with step n-1 was already queued in step n: that token is discarded and its
blocks are freed at once (the device runs steps in order, so no later step can overwrite them
before step n is done with them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat

from backend.distributed.tensor_parallel import TensorParallelError
from backend.engine.output_processor import OutputProcessor
from backend.engine.step_runner import StepRunner
from backend.request import Chunk, FinishReason, Request
from backend.sampling.sampler import PendingSample, Sampler
from backend.scheduling.scheduler import Scheduler, SchedulerOutput
from backend.speculative.ngram import NgramProposer
from backend.speculative.verification import accepted_tokens, may_speculate

log = logging.getLogger(__name__)
STEP_FAILED = "the model step failed for this request"


def reads_token_history(request: Request) -> bool:
    """Whether sampling this request's next token reads its output ids on the host. The
    min-tokens end ban reads only how many there are, which an in-flight token counts in."""
    p = request.sampling
    return bool(
        p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.bad_token_ids
    )


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device: the requests it samples for, in row order, and their
    sampled ids on the way to the host; None when the step failed (then its requests fail)
    or samples for none."""

    requests: list[Request]
    sampled: PendingSample | None
    # Speculative decoding: each request's drafts (its rows: 1 + len(drafts), in order); None
    # when no chunk of the step carries drafts (then one row per request).
    drafts: list[list[int]] | None = None


class Engine:
    def __init__(
        self,
        runner: StepRunner,
        sampler: Sampler,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        lock: threading.Lock,
        overlap: bool,
        on_step: Callable[[SchedulerOutput], None] = lambda batch: None,
        proposer: NgramProposer | None = None,
    ):
        """`lock` guards the scheduler (the executor's lock); everything else here runs on the
        executor thread only. `on_step(batch)` is called under `lock` once a step has run,
        before any of its tokens is delivered (the executor counts it in its stats).
        `proposer`: drafts for speculative decoding (then `overlap` must be off: drafts follow the
        newest token, which must be on the host when the next step is scheduled)."""
        if proposer is not None and overlap:
            raise ValueError("speculative decoding needs overlap scheduling off")
        self.runner = runner
        self.sampler = sampler
        self.scheduler = scheduler
        self.outputs = outputs
        self.overlap = overlap
        self.on_step = on_step
        self._lock = lock
        self.in_flight: LaunchedStep | None = None  # the step whose tokens are in flight
        self.device_wait_s = 0.0  # cumulative: waiting for sampled ids (see ExecutorStats)
        # Ids of requests for which `reads_token_history` (kept by the executor, under `lock`):
        # when empty, as usual, no step has to look for them.
        self.history_requests: set[str] = set()
        # Ids of live requests that asked for prompt log-probs (same keeping): when empty, no step
        # looks at its chunks for prompt rows.
        self.prompt_logprob_requests: set[str] = set()
        self.proposer = proposer
        # Speculative decoding, cumulative: decodes that carried drafts, drafts, accepted drafts.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_draft_tokens = 0

    def step(self) -> SchedulerOutput | None:
        """Run one step (n); with overlap, finish the one in flight (n-1). Returns what ran."""
        if self.proposer is not None:
            self._propose_drafts()
        with self._lock:
            batch = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        if previous is not None and (
            not batch.chunks or batch.preempted or self._reads_history(batch.chunks)
        ):
            self._finish(previous)  # drain: n-1's tokens are real before n
            previous = None
            batch.chunks = [c for c in batch.chunks if not c.request.is_finished]
        if not batch.chunks:
            return None
        try:
            launched = [self._launch(batch.chunks, previous)]  # nothing waits for the device
        except TensorParallelError:  # no request is at fault: the engine cannot compute
            raise
        except Exception:
            log.exception("batched step failed; running its requests one at a time")
            if previous is not None:
                self._finish(previous)
                previous = None
            launched = [self._launch_alone(c) for c in batch.chunks if not c.request.is_finished]
        if previous is not None:
            self._finish(previous)  # n-1's tokens: append, stops, delivery
        with self._lock:
            self.scheduler.complete_step(batch)  # computed counts, full-block hashes
            self.on_step(batch)
        if self.overlap and len(launched) == 1 and launched[0].sampled is not None:
            self._put_in_flight(launched[0])  # n's tokens: on the device until n+1
        else:
            for launched_step in launched:
                self._finish(launched_step)
        return batch

    # ---- the parts of a step -------------------------------------------------------------------
    def _launch(self, chunks: list[Chunk], previous: LaunchedStep | None) -> LaunchedStep:
        """Queue the forward pass and the sampling of one step on the device."""
        requests = [c.request for c in chunks if c.samples]
        rows, drafts = requests, None
        if self.proposer is not None and any(c.draft_ids for c in chunks):
            drafts = [list(c.draft_ids) for c in chunks if c.samples]
            rows = [r for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
        in_flight_ids = previous.sampled.token_ids if previous is not None else None
        out = self.runner.execute(
            chunks,
            in_flight_ids,
            self.sampler.end_bans(rows),
            prompt_logprobs=bool(self.prompt_logprob_requests),
        )
        sampled = None
        if requests:
            sampled = self.sampler.sample_async(out.logits, rows, out.argmax_ids, out.argmax_host)
        if out.prompt:  # recorded once the step's work is all queued: a retry recomputes them
            for prompt, logprobs, top in out.prompt:
                prompt.add(logprobs, top)
        return LaunchedStep(requests, sampled, drafts)

    def _launch_alone(self, chunk: Chunk) -> LaunchedStep:
        """One chunk as its own step; if it fails, its request fails, sampling or not (its KV
        was not written). Re-running a chunk rewrites the same KV values."""
        try:
            return self._launch([chunk], None)
        except TensorParallelError:
            raise
        except Exception:
            log.exception("request %s failed in the model step", chunk.request.request_id)
            return LaunchedStep([chunk.request], None)

    def _put_in_flight(self, step: LaunchedStep) -> None:
        for row, request in enumerate(step.requests):
            if not request.is_finished:  # not ended by step n-1
                request.in_flight_row = row
        self.in_flight = step

    def _finish(self, step: LaunchedStep) -> None:
        """Wait for a step's sampled ids; append each request's token, check stops, deliver."""
        requests, sampled = step.requests, None
        if step.sampled is not None:
            waited = time.perf_counter()
            try:
                sampled = step.sampled.result()
            except Exception:
                log.exception("the step failed on the device")
            self.device_wait_s += time.perf_counter() - waited
        if sampled is None:
            for request in requests:
                request.in_flight_row = None
                self.outputs.finish(request, FinishReason.ERROR, error=STEP_FAILED)
            return
        now = time.time()
        if step.drafts is not None:
            self._finish_verified(requests, step.drafts, sampled, now)
            return
        append = self.outputs.append
        top_ids = sampled.top_ids
        if top_ids is not None:  # (top-k ids, top-k log-probs) per row
            tops = zip(top_ids, sampled.top_logprobs)
        for request, token, logprob, top in zip(
            requests,
            sampled.token_ids,
            sampled.logprobs or repeat(0.0),
            tops if top_ids is not None else repeat(None),
        ):
            request.in_flight_row = None
            try:
                append(request, token, logprob, now, top)
            except Exception as exc:  # a faulty callback or bookkeeping bug: this request alone
                log.exception("request %s failed", request.request_id)
                self.outputs.finish(request, FinishReason.ERROR, error=f"internal error: {exc}")

    def _propose_drafts(self) -> None:
        """Drafts for each running request that decodes next and may be speculated, at most as
        many as leave room for the target's token after them within max_tokens. The scans run
        outside the lock (only this thread changes a running request's tokens), so submitters
        do not wait for them."""
        propose = self.proposer.propose
        with self._lock:
            running = list(self.scheduler.running)
        for request in running:
            request.draft_ids = []
            if request.num_computed_tokens + 1 == request.num_tokens and may_speculate(request):
                room = request.sampling.max_tokens - len(request.output_ids) - 1
                if room > 0:
                    request.draft_ids = propose(request.all_ids, room)

    def _finish_verified(self, requests, drafts, sampled, now: float) -> None:
        """`_finish` for a step with drafts: each request's rows verify its drafts (greedy:
        `accepted_tokens`); the tokens kept are appended as a run, the rejected drafts' KV is
        handed back. A request without drafts takes its one row as usual."""
        ids, logprobs, top_ids = sampled.token_ids, sampled.logprobs, sampled.top_ids
        row = 0
        for request, draft in zip(requests, drafts):
            request.in_flight_row = None
            try:
                if not draft:
                    top = None if top_ids is None else (top_ids[row], sampled.top_logprobs[row])
                    logprob = 0.0 if logprobs is None else logprobs[row]
                    self.outputs.append(request, ids[row], logprob, now, top)
                else:
                    tokens, accepted = accepted_tokens(draft, ids[row : row + len(draft) + 1])
                    self._count_drafts(request, len(draft), accepted)
                    self.outputs.append_run(request, tokens, now)
                    with self._lock:
                        self.scheduler.settle_drafts(request, accepted)
            except Exception as exc:  # as in `_finish`: this request alone
                log.exception("request %s failed", request.request_id)
                self.outputs.finish(request, FinishReason.ERROR, error=f"internal error: {exc}")
            row += len(draft) + 1

    def _count_drafts(self, request: Request, drafted: int, accepted: int) -> None:
        request.num_draft_tokens += drafted
        request.num_accepted_draft_tokens += accepted
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_draft_tokens += accepted

    def _reads_history(self, chunks: list[Chunk]) -> bool:
        """Whether a request with a token in flight reads its output ids on the host to be
        sampled this step: then that token must be real first."""
        history = self.history_requests
        return bool(history) and any(
            c.request.in_flight_row is not None and c.request.request_id in history for c in chunks
        )

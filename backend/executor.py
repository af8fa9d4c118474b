"""The engine executor: a background thread running the in-flight batching loop.

One iteration: schedule (token budget, KV blocks) -> run the model on one packed batch -> sample ->
append tokens, check stops, deliver outputs, free finished requests.

`submit`, `cancel` and `stats` are thread-safe. Outputs reach the caller through the `on_output`
callback, called from the executor thread; every request gets exactly one output with
`finished=True`, whatever the reason it ends. An exception while serving one request fails that
request alone and the loop goes on.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from backend.config import EngineConfig
from backend.model_runner import ModelRunner, SequenceChunk
from backend.request import FinishReason, Request, RequestOutput, RequestStatus
from backend.sampler import Sampler
from backend.sampling_params import SamplingParams
from backend.scheduler import QueueFullError, ScheduledChunk, Scheduler, SchedulerOutput
from backend.stats import ExecutorStats
from backend.stopping import check_finish

__all__ = ["Executor", "QueueFullError"]

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]


class _Live:
    """Delivery state of one request, beside the engine-side Request."""

    __slots__ = ("request", "callback", "num_delivered", "cum_logprob")

    def __init__(self, request: Request, callback: OutputCallback):
        self.request = request
        self.callback = callback
        self.num_delivered = 0
        self.cum_logprob = 0.0


class Executor:
    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None):
        self.config = config or EngineConfig()
        self.config.validate()
        self.runner = runner or ModelRunner(self.config)
        self.max_seq_len = self.runner.max_seq_len
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = list(self.runner.eos_token_ids)
        self.model_dir = self.runner.model_dir
        self.scheduler = Scheduler(self.config, self.runner.num_kv_blocks, self.runner.tokens_per_block)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, self.runner.device, self.config.seed)
        self._stats = ExecutorStats(kv=self.scheduler.kv_stats())
        self._live: dict[str, _Live] = {}
        self._cancel_requests: set[str] = set()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()

    # ---- public, thread-safe -------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
               on_output: OutputCallback) -> None:
        """Validate and queue a request. Raises ValueError (bad input) or QueueFullError."""
        request = Request(str(request_id), list(prompt_ids), self._checked(prompt_ids, sampling))
        with self._lock:
            if self._stopping:
                raise RuntimeError("executor is shut down")
            if request.request_id in self._live:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self.scheduler.add(request)
            self._live[request.request_id] = _Live(request, on_output)
            self._work.notify()

    def cancel(self, request_id: str) -> bool:
        """Ask the loop to end a request; it gets a final output with reason `cancelled`."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._cancel_requests.add(request_id)
            self._work.notify()
            return True

    def stats(self) -> ExecutorStats:
        with self._lock:
            return replace(self._stats, kv=self.scheduler.kv_stats(), finish_reasons=dict(self._stats.finish_reasons),
                           num_waiting=self.scheduler.num_waiting, num_running=self.scheduler.num_running)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify()
        self._thread.join(timeout=30)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 timeout: float | None = None) -> list[dict]:
        """Serve prompts concurrently and block until all finish. Returns one dict per prompt:
        token_ids, logprobs, finish_reason, error."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        results = [{"token_ids": [], "logprobs": [], "finish_reason": None, "error": None} for _ in prompts]
        done = threading.Semaphore(0)
        tag = f"gen-{time.monotonic_ns()}"

        def collect(index: int) -> OutputCallback:
            def on_output(out: RequestOutput) -> None:
                results[index]["token_ids"] += out.new_token_ids
                results[index]["logprobs"] += out.new_logprobs
                if out.finished:
                    results[index]["finish_reason"] = out.finish_reason
                    results[index]["error"] = out.error
                    done.release()
            return on_output

        for i, (ids, p) in enumerate(zip(prompts, params)):
            self.submit(f"{tag}-{i}", ids, p, collect(i))
        for _ in prompts:
            if not done.acquire(timeout=timeout):
                raise TimeoutError("generate timed out")
        return results

    # ---- validation ----------------------------------------------------------------------------
    def _checked(self, prompt_ids: list[int], sampling: SamplingParams) -> SamplingParams:
        if len(prompt_ids) == 0:
            raise ValueError("prompt must not be empty")
        for token in prompt_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {token!r}")
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; it must be shorter than "
                             f"max_seq_len ({self.max_seq_len})")
        sampling.validate(self.vocab_size)
        # Generation stops at max_seq_len: cap max_tokens so capacity planning sees the true need.
        sampling = replace(sampling, max_tokens=min(sampling.max_tokens, self.max_seq_len - len(prompt_ids)))
        needed = self.scheduler.blocks_needed(len(prompt_ids) + sampling.max_tokens)
        if needed > self.scheduler.total_blocks:
            raise ValueError(f"request needs {needed} KV cache blocks (prompt {len(prompt_ids)} + max_tokens "
                             f"{sampling.max_tokens} tokens) but the cache holds {self.scheduler.total_blocks}; "
                             "lower max_tokens or raise max_tokens_in_paged_kv_cache")
        return sampling

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._cancel_requests and not self.scheduler.has_work():
                    self._work.wait()
                stopping = self._stopping
                cancelled, self._cancel_requests = self._cancel_requests, set()
            if stopping:
                for live in list(self._live.values()):
                    self._finish(live.request, FinishReason.CANCELLED, error="executor shut down")
                return
            for request_id in cancelled:
                live = self._live.get(request_id)
                if live is not None:
                    self._finish(live.request, FinishReason.CANCELLED)
            with self._lock:
                output = self.scheduler.schedule()
            if not output.chunks:
                time.sleep(0.001)
                continue
            try:
                self._step(output)
            except Exception:  # never let the loop die
                log.exception("executor step failed")
            self._record_step(output)

    def _record_step(self, output: SchedulerOutput) -> None:
        decodes = sum(1 for c in output.chunks if c.num_tokens == 1 and c.request.output_ids)
        with self._lock:
            stats = self._stats
            stats.num_iterations += 1
            stats.num_preemptions += len(output.preempted)
            stats.last_num_scheduled_tokens = output.num_batched_tokens
            stats.last_num_generation_requests = decodes
            stats.last_num_context_requests = len(output.chunks) - decodes

    def _step(self, output: SchedulerOutput) -> None:
        sampling_chunks = [c for c in output.chunks if c.samples]
        results = self._forward_and_sample(output.chunks)
        with self._lock:
            self.scheduler.complete_step(output)
        now = time.time()
        for chunk, result in zip(sampling_chunks, results):
            request = chunk.request
            if result is None:
                self._finish(request, FinishReason.ERROR, error="the model step failed for this request")
                continue
            try:
                self._append(request, result[0], result[1], now)
            except Exception as exc:  # a faulty callback or bookkeeping bug: this request alone
                log.exception("request %s failed", request.request_id)
                self._finish(request, FinishReason.ERROR, error=f"internal error: {exc}")

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
        seq_chunks = []
        for c in chunks:
            r = c.request
            start = r.num_computed_tokens
            seq_chunks.append(SequenceChunk(r.tokens(start, start + c.num_tokens), start, r.block_ids, c.samples))
        logits = self.runner.execute(seq_chunks)
        requests = [c.request for c in chunks if c.samples]
        if not requests:
            return []
        sampled = self.sampler.sample(logits, requests)
        logprobs = sampled.logprobs or [0.0] * len(requests)
        return list(zip(sampled.token_ids, logprobs))

    # ---- per-request bookkeeping (executor thread) ---------------------------------------------
    def _append(self, request: Request, token: int, logprob: float, now: float) -> None:
        live = self._live.get(request.request_id)
        if live is None or request.is_finished:
            return
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        reason, deliverable = check_finish(request, self._end_ids(request), self.max_seq_len)
        self._deliver(live, deliverable, reason)

    def _deliver(self, live: _Live, deliverable: int, reason: FinishReason | None,
                 error: str | None = None) -> None:
        request = live.request
        deliverable = max(deliverable, live.num_delivered)
        new_ids = request.output_ids[live.num_delivered:deliverable]
        new_logprobs = request.output_logprobs[live.num_delivered:deliverable] if request.sampling.return_log_probs else []
        live.num_delivered = deliverable
        live.cum_logprob += sum(new_logprobs)
        finished = reason is not None
        if finished:
            self._release(request, reason, error)
        if not new_ids and not finished:
            return
        out = RequestOutput(
            request_id=request.request_id, new_token_ids=new_ids, new_logprobs=new_logprobs,
            num_output_tokens=deliverable, finished=finished, finish_reason=reason, error=error,
            num_prompt_tokens=request.num_prompt_tokens, num_reused_blocks=request.num_reused_blocks,
            num_new_blocks=request.num_new_blocks, cum_logprob=live.cum_logprob,
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time, last_token_time=request.last_token_time)
        with self._lock:
            self._stats.num_generated_tokens += len(new_ids)
        try:
            live.callback(out)
        except Exception:
            log.exception("on_output callback failed for request %s", request.request_id)
            if not finished:
                self._finish(request, FinishReason.ERROR, error="the output callback failed")

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request early (cancel, error): deliver what is held back, then the final flag."""
        live = self._live.get(request.request_id)
        if live is None or request.is_finished:
            return
        self._deliver(live, len(request.output_ids) if reason != FinishReason.ERROR else live.num_delivered,
                      reason, error)

    def _release(self, request: Request, reason: FinishReason, error: str | None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        with self._lock:
            self.scheduler.finish(request)
            self._live.pop(request.request_id, None)
            self._cancel_requests.discard(request.request_id)
            stats = self._stats
            stats.num_completed += 1
            stats.num_prompt_tokens += request.num_prompt_tokens
            stats.num_failed += reason == FinishReason.ERROR
            stats.num_cancelled += reason == FinishReason.CANCELLED
            stats.finish_reasons[reason.value] = stats.finish_reasons.get(reason.value, 0) + 1
        self.sampler.forget(request.request_id)

    def _end_ids(self, request: Request) -> list[int]:
        end_id = request.sampling.end_id
        return self.eos_token_ids if end_id is None else [end_id]

"""The engine executor: a background thread running the in-flight batching loop.

The loop waits for work, applies cancellations and runs `Engine.step` (`backend.engine.step`):
schedule (token budget, KV blocks) -> run the model on one packed batch -> sample -> append tokens,
check stops, deliver outputs, free finished requests.

`submit`, `cancel` and `stats` are thread-safe. Outputs reach the caller through the `on_output`
callback, called from the executor thread; every request gets exactly one output with
`finished=True`, whatever the reason it ends. An exception while serving one request fails that
request alone and the loop goes on; one that leaves the engine unable to compute (a
tensor-parallel rank died) fails every request with its message and stops the executor
(`error` is set, `ready` false, `on_fatal` is called).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import torch

from backend.config import EngineConfig
from backend.distributed.tensor_parallel import TensorParallelError
from backend.engine.limits import EngineLimits
from backend.engine.output_processor import OutputCallback, OutputProcessor
from backend.engine.stats import ExecutorStats
from backend.engine.step import Engine, reads_token_history
from backend.engine.step_runner import StepRunner
from backend.logprobs import PromptLogprobs
from backend.request import FinishReason, Request, RequestOutput
from backend.runner.model_runner import ModelRunner
from backend.sampling.sampler import Sampler
from backend.sampling_params import SamplingParams
from backend.scheduling.kv_cache_manager import KVCacheManager
from backend.scheduling.scheduler import QueueFullError, Scheduler, SchedulerOutput
from backend.speculative.ngram import NgramProposer

__all__ = ["Executor", "QueueFullError"]

log = logging.getLogger(__name__)


class Executor:
    def __init__(self, config: EngineConfig | None = None, runner: StepRunner | None = None):
        self.config = config or EngineConfig()
        self.config.validate()
        self._owns_runner = runner is None
        self.runner: StepRunner = runner or ModelRunner(self.config)
        self.max_seq_len = self.runner.max_seq_len
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = list(self.runner.eos_token_ids)
        self.model_dir = self.runner.model_dir
        model_config = self.runner.model_config
        self.scheduler = Scheduler(
            self.config,
            self.runner.kv_group_blocks,
            self.runner.tokens_per_block,
            attention_window=[group.window for group in model_config.kv_cache_groups],
            sink_tokens=model_config.sink_token_length,
        )
        self.limits = EngineLimits(
            self.vocab_size,
            self.max_seq_len,
            self.runner.tokens_per_block,
            *binding_limits(self.scheduler.kv, self.max_seq_len),
            lora_names=tuple(self.config.lora_adapters()),
        )
        self.sampler = Sampler(
            self.vocab_size, self.eos_token_ids, self.runner.device, self.config.seed
        )
        self._stats = ExecutorStats(kv=self.scheduler.kv_stats())
        self._last_step_decoded = False  # the step before ran no prompt chunk (_record_step)
        self._streak_step = False  # the step running is a steady decode step
        self.outputs = OutputProcessor(
            self.max_seq_len, self.eos_token_ids, self._release, self.config.stream_interval
        )
        self._live = self.outputs.live  # request_id -> LiveRequest, guarded by _lock
        self._cancel_requests: set[str] = set()
        self._lock = threading.Lock()
        # Overlap scheduling (see backend.engine.step): on by default where there is a device to
        # overlap with; forced on in tests to exercise it on CPU; off with speculative decoding.
        overlap = self.config.overlap_scheduling
        self.overlap = self.runner.device.type == "cuda" if overlap is None else bool(overlap)
        proposer = None
        if self.config.speculative_method == "ngram":
            c = self.config
            proposer = NgramProposer(
                c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens
            )
            self.overlap = False
        self.engine = Engine(
            self.runner,
            self.sampler,
            self.scheduler,
            self.outputs,
            self._lock,
            self.overlap,
            on_step=self._record_step,
            proposer=proposer,
        )
        self._work = threading.Condition(self._lock)
        self._stopping = False
        self._stop_reason = "executor shut down"
        self.error: str | None = None  # why the engine cannot compute any more
        self.on_fatal = lambda message: None  # called once, when `error` is set
        # Called on the executor thread after each pass of its loop that may have delivered
        # outputs, before it can sleep: a caller that queues outputs sends them then.
        self.on_delivered = lambda: None
        self.runner.on_fatal = self._fail
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()

    # ---- public, thread-safe -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether the executor serves (neither shut down nor failed)."""
        return not self._stopping

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        on_output: OutputCallback,
    ) -> None:
        """Validate and queue a request. Raises ValueError (bad input) or QueueFullError."""
        self._queue([(self._request(request_id, prompt_ids, sampling), on_output)])

    def _request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams):
        request = Request(
            str(request_id), list(prompt_ids), self.limits.check(prompt_ids, sampling)
        )
        if request.sampling.return_prompt_log_probs:
            request.prompt_logprobs = PromptLogprobs(
                len(request.prompt_ids), request.sampling.num_top_log_probs
            )
        return request

    def _queue(self, requests: list[tuple[Request, OutputCallback]]) -> None:
        """Queue validated requests together: the loop sees all of them or none."""
        with self._lock:
            if self._stopping:
                raise RuntimeError(self.error or "executor is shut down")
            for request, on_output in requests:
                if request.request_id in self._live:
                    raise ValueError(f"request_id {request.request_id!r} is already in flight")
                self.scheduler.add(request)
                self.outputs.add(request, on_output)
                if reads_token_history(request):
                    self.engine.history_requests.add(request.request_id)
                if request.prompt_logprobs is not None:
                    self.engine.prompt_logprob_requests.add(request.request_id)
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
        """A snapshot. The last step's counts read 0 once the engine is idle (no step is
        running)."""
        with self._lock:
            stats = replace(
                self._stats,
                kv=self.scheduler.kv_stats(),
                finish_reasons=dict(self._stats.finish_reasons),
                num_waiting=self.scheduler.num_waiting,
                num_running=self.scheduler.num_running,
            )
            if not self.scheduler.has_work():
                stats.last_num_context_requests = stats.last_num_generation_requests = 0
                stats.last_num_scheduled_tokens = 0
            return stats

    def shutdown(self, reason: str = "executor shut down") -> None:
        """Stop the loop (requests in flight end as cancelled, with `reason` as their error);
        then free the model, KV cache and CUDA graphs of a runner this executor built (an
        injected runner stays the caller's)."""
        with self._lock:
            self._stopping = True
            self._stop_reason = self.error or reason  # a failure keeps its own message
            self._work.notify()
        self._thread.join(timeout=30)
        if self._owns_runner and not self._thread.is_alive():
            self.runner.release()

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        timeout: float | None = None,
    ) -> list[dict]:
        """Serve prompts concurrently and block until all finish. Returns one dict per prompt:
        token_ids, logprobs, top_ids, top_logprobs (per token, with num_top_log_probs),
        prompt_logprobs, prompt_top_ids, prompt_top_logprobs (with return_prompt_log_probs, else
        None), finish_reason, error, draft_tokens and accepted_draft_tokens (speculative
        decoding: drafts verified for the prompt, and of them accepted)."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        results = [
            {
                "token_ids": [],
                "logprobs": [],
                "top_ids": [],
                "top_logprobs": [],
                "prompt_logprobs": None,
                "prompt_top_ids": None,
                "prompt_top_logprobs": None,
                "finish_reason": None,
                "error": None,
                "draft_tokens": 0,
                "accepted_draft_tokens": 0,
            }
            for _ in prompts
        ]
        done = threading.Semaphore(0)
        tag = f"gen-{time.monotonic_ns()}"

        def collect(index: int) -> OutputCallback:
            def on_output(out: RequestOutput) -> None:
                results[index]["token_ids"] += out.new_token_ids
                result = results[index]
                result["logprobs"] += out.new_logprobs
                result["top_ids"] += out.new_top_ids or []
                result["top_logprobs"] += out.new_top_logprobs or []
                if out.prompt_logprobs is not None:
                    result["prompt_logprobs"] = out.prompt_logprobs
                    result["prompt_top_ids"] = out.prompt_top_ids
                    result["prompt_top_logprobs"] = out.prompt_top_logprobs
                result["draft_tokens"] = out.num_draft_tokens
                result["accepted_draft_tokens"] = out.num_accepted_draft_tokens
                if out.finished:
                    results[index]["finish_reason"] = out.finish_reason
                    results[index]["error"] = out.error
                    done.release()

            return on_output

        requests = [
            self._request(f"{tag}-{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        # Queued together, so the loop's first step can take them all.
        self._queue([(request, collect(i)) for i, request in enumerate(requests)])
        for _ in prompts:
            if not done.acquire(timeout=timeout):
                raise TimeoutError("generate timed out")
        return results

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        # Every tensor the loop creates or updates (step inputs, logits, sampled ids) lives in
        # inference mode: no autograd bookkeeping, and in-place updates of them stay legal.
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            self.on_delivered()
            with self._lock:
                while (
                    not self._stopping
                    and not self._cancel_requests
                    and engine.in_flight is None
                    and not self.scheduler.has_work()
                ):
                    self._work.wait()
                stopping = self._stopping
                cancelled, self._cancel_requests = self._cancel_requests, set()
            if stopping:
                reason = FinishReason.CANCELLED if self.error is None else FinishReason.ERROR
                for live in list(self._live.values()):
                    self.outputs.finish(live.request, reason, error=self._stop_reason)
                self.on_delivered()
                return
            for request_id in cancelled:
                live = self._live.get(request_id)
                if live is not None:
                    self.outputs.finish(live.request, FinishReason.CANCELLED)
            was_in_flight = engine.in_flight is not None
            started = time.perf_counter()
            try:
                ran = engine.step()
            except TensorParallelError as exc:  # raised anywhere in the step: name a dead rank
                self._fail(str(self.runner.explain(exc)))
                continue
            except Exception:  # never let the loop die
                log.exception("executor step failed")
                continue
            self._time_step(ran, time.perf_counter() - started)
            if ran is None and not was_in_flight:
                time.sleep(0.001)  # nothing could be scheduled yet (KV blocks, budget)

    def _fail(self, message: str) -> None:
        """The engine cannot compute again: stop; every live request ends with `message`."""
        with self._lock:
            if self.error is not None:
                return
            log.error("the engine failed: %s", message)
            self.error = self._stop_reason = message
            self._stopping = True
            self._work.notify()
        self.on_fatal(message)

    def _time_step(self, ran: SchedulerOutput | None, seconds: float) -> None:
        """Add a step's wall time to the stats (see ExecutorStats; `_record_step` counted it):
        only this thread writes those fields, so no lock. A step's time lands after its outputs
        were delivered, its count before."""
        stats = self._stats
        stats.step_seconds += seconds
        stats.device_wait_seconds = self.engine.device_wait_s
        engine = self.engine
        stats.num_drafts = engine.num_drafts
        stats.num_draft_tokens = engine.num_draft_tokens
        stats.num_accepted_draft_tokens = engine.num_accepted_draft_tokens
        if ran is None:
            self._last_step_decoded = False
        elif self._streak_step:
            stats.decode_streak_seconds += seconds

    def _record_step(self, batch: SchedulerOutput) -> None:
        """Engine hook, under `_lock`: a step ran."""
        decodes = sum(  # a decode's drafts make it no prompt chunk
            1
            for c in batch.chunks
            if c.num_tokens - len(c.draft_ids) == 1 and c.start >= len(c.request.prompt_ids)
        )
        stats = self._stats
        stats.num_iterations += 1
        stats.num_context_iterations += decodes < len(batch.chunks)
        decoded = decodes == len(batch.chunks)
        self._streak_step = decoded and self._last_step_decoded
        stats.num_decode_streak_steps += self._streak_step
        self._last_step_decoded = decoded
        stats.num_preemptions += len(batch.preempted)
        stats.last_num_scheduled_tokens = batch.num_batched_tokens
        stats.last_num_generation_requests = decodes
        stats.last_num_context_requests = len(batch.chunks) - decodes
        self._flush_token_count()

    def _flush_token_count(self) -> None:
        """Delivered tokens reach the stats once per step (and when a request ends), not per
        output: taking the lock for every request of every step is measurable. Hold `_lock`."""
        self._stats.num_generated_tokens += self.outputs.num_unflushed_tokens
        self.outputs.num_unflushed_tokens = 0

    # ---- request end (executor thread) ---------------------------------------------------------
    def _release(self, request: Request, reason: FinishReason, error: str | None) -> None:
        """OutputProcessor hook: the request ended. Free its blocks, forget it, count it."""
        with self._lock:
            self.scheduler.finish(request)
            self._live.pop(request.request_id, None)
            self._cancel_requests.discard(request.request_id)
            self.engine.history_requests.discard(request.request_id)
            self.engine.prompt_logprob_requests.discard(request.request_id)
            stats = self._stats
            stats.num_completed += 1
            stats.num_prompt_tokens += request.num_prompt_tokens
            stats.num_failed += reason == FinishReason.ERROR
            stats.num_cancelled += reason == FinishReason.CANCELLED
            stats.finish_reasons[reason.value] = stats.finish_reasons.get(reason.value, 0) + 1
            self._flush_token_count()
        self.sampler.forget(request.request_id)


def binding_limits(kv: KVCacheManager, max_seq_len: int) -> tuple[int, int | None]:
    """(total_blocks, max_blocks_held) for `EngineLimits`: a request is refused when some group's
    pool cannot hold the blocks it holds at once, which is the case exactly when its blocks
    exceed the smallest pool among the groups whose longest request would not fit."""
    short = [
        group.pool.num_blocks
        for group in kv.groups
        if group.max_blocks_held(max_seq_len) > group.pool.num_blocks
    ]
    if short:
        return min(short), None
    first = kv.groups[0]
    return first.pool.num_blocks, first.max_blocks_held(max_seq_len)

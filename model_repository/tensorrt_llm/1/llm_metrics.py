"""Prometheus metrics of the LLM model, through pb_utils.MetricFamily, with TensorRT-LLM's names.

Gauges are refreshed from the engine's stats every stats period; per-request histograms are
observed when requests finish (queued by the response thread, observed here, so the token path
makes no metric IPC). With several instances of the model, the gauges come from the instance
that started the engine and the request families carry an `instance` label (two stubs adding
the same series crashed tritonserver 2.51: heap corruption under load). Families and label values:

  nv_trt_llm_request_metrics{request_type=active|max|scheduled|context|waiting}
  nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per|reused|fraction}
  nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric=
      total_context_tokens|generation_requests|micro_batch_id|preemptions|context_iterations}
  nv_trt_llm_general_metrics{general_type=iteration_counter|timestamp}   (timestamp: µs since epoch)
  nv_llm_engine_step_metrics{engine_step_metric=step_seconds|device_wait_seconds|
      decode_streak_steps|decode_streak_seconds}  (cumulative; see
      backend.engine.stats.ExecutorStats)
  nv_llm_input_token_len / nv_llm_output_token_len  histograms, buckets 10 50 100 500 1000
  nv_llm_requests_finished_total{finish_reason=length|stop|end_id|cancelled|error}  counter
  nv_llm_requests_rejected_total{reason=queue_full|shutting_down|invalid}  counter
  nv_llm_time_to_first_token_seconds, nv_llm_inter_token_latency_seconds (mean per request),
  nv_llm_request_latency_seconds  histograms
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

TOKEN_BUCKETS = [10, 50, 100, 500, 1000]
LATENCY_BUCKETS = [
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
]
FINISH_REASONS = ("length", "stop", "end_id", "cancelled", "error")
REJECT_REASONS = ("queue_full", "shutting_down", "invalid")


@dataclass
class FinishedRequest:
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: str
    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    end_time: float
    rejected: str | None = None  # why the engine refused it (see REJECT_REASONS)


class LlmMetrics:
    """`engine_gauges`: this instance publishes the engine's gauges (one instance of several
    does). `instance`: the label that tells this instance's request counts and histograms from
    the other instances' (None with one instance); Prometheus sums them."""

    def __init__(
        self,
        model_name: str,
        model_version: str,
        max_batch_size: int,
        engine_gauges: bool = True,
        instance: str | None = None,
    ):
        self._labels = {"model": model_name, "version": model_version}
        self._request_labels = {**self._labels, **({"instance": instance} if instance else {})}
        self._max_batch_size = max_batch_size
        self._finished: queue.SimpleQueue[FinishedRequest] = queue.SimpleQueue()
        self._gauge_values: dict[int, float] = {}
        self._families = []
        self.engine_gauges = engine_gauges
        if engine_gauges:
            self._engine_families()
        self._request_families()

    def _engine_families(self) -> None:
        self.request = self._gauges(
            "nv_trt_llm_request_metrics",
            "TRT LLM request metrics",
            "request_type",
            ("active", "max", "scheduled", "context", "waiting"),
        )
        self.kv = self._gauges(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            "kv_cache_block_type",
            ("max", "free", "used", "tokens_per", "reused", "fraction"),
        )
        self.ifb = self._gauges(
            "nv_trt_llm_inflight_batcher_metrics",
            "TRT LLM inflight batcher metrics",
            "inflight_batcher_specific_metric",
            (
                "total_context_tokens",
                "generation_requests",
                "micro_batch_id",
                "preemptions",
                "context_iterations",
            ),
        )
        self.general = self._gauges(
            "nv_trt_llm_general_metrics",
            "General TRT LLM metrics",
            "general_type",
            ("iteration_counter", "timestamp"),
        )
        self.steps = self._gauges(
            "nv_llm_engine_step_metrics",
            "Where the engine's step thread spends its time (cumulative)",
            "engine_step_metric",
            ("step_seconds", "device_wait_seconds", "decode_streak_steps", "decode_streak_seconds"),
        )
        # vLLM's spec_decode counters under our prefix (cumulative; rate() them)
        self.spec_decode = self._gauges(
            "nv_llm_spec_decode_metrics",
            "Speculative decoding: decodes that carried drafts, drafted and accepted tokens",
            "spec_decode_metric",
            ("num_drafts", "num_draft_tokens", "num_accepted_tokens"),
        )

    def _request_families(self) -> None:
        self.input_len = self._histogram(
            "nv_llm_input_token_len",
            "TRT LLM response metrics",
            {"response_metric_type": "total_input_tokens"},
            TOKEN_BUCKETS,
        )
        self.output_len = self._histogram(
            "nv_llm_output_token_len",
            "TRT LLM response metrics",
            {"response_metric_type": "total_output_tokens"},
            TOKEN_BUCKETS,
        )
        self.ttft = self._histogram(
            "nv_llm_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            {},
            LATENCY_BUCKETS,
        )
        self.itl = self._histogram(
            "nv_llm_inter_token_latency_seconds",
            "Mean time between generated tokens, per request",
            {},
            LATENCY_BUCKETS,
        )
        self.latency = self._histogram(
            "nv_llm_request_latency_seconds",
            "Time from arrival to the last response",
            {},
            LATENCY_BUCKETS,
        )
        counter = pb_utils.MetricFamily.COUNTER
        self.finished = self._labelled(
            "nv_llm_requests_finished_total",
            "Finished engine requests by finish reason",
            "finish_reason",
            FINISH_REASONS,
            counter,
        )
        self.rejected = self._labelled(
            "nv_llm_requests_rejected_total",
            "Requests the engine refused, by reason",
            "reason",
            REJECT_REASONS,
            counter,
        )

    # ---- called from the response thread: cheap, no IPC ----------------------------------------
    def record_finished(self, item: FinishedRequest) -> None:
        self._finished.put(item)

    def record_rejected(self, reason: str) -> None:
        """A request refused before it reached the engine (bad input checked in this stub)."""
        self._finished.put(reason)

    # ---- called from the poll thread -----------------------------------------------------------
    def update(self, stats) -> None:
        if self.engine_gauges:
            self._set_engine_gauges(stats)
        self.observe_finished()

    def _set_engine_gauges(self, stats) -> None:
        kv = stats.kv
        scheduled = stats.last_num_context_requests + stats.last_num_generation_requests
        self._set(
            self.request,
            active=stats.num_running,
            max=self._max_batch_size,
            scheduled=scheduled,
            context=stats.last_num_context_requests,
            waiting=stats.num_waiting,
        )
        self._set(
            self.kv,
            max=kv.max_blocks,
            free=kv.free_blocks,
            used=kv.used_blocks,
            tokens_per=kv.tokens_per_block,
            reused=kv.reused_blocks,
            fraction=kv.used_blocks / kv.max_blocks if kv.max_blocks else 0.0,
        )
        self._set(
            self.ifb,
            generation_requests=stats.last_num_generation_requests,
            micro_batch_id=0,
            total_context_tokens=max(
                0, stats.last_num_scheduled_tokens - stats.last_num_generation_requests
            ),
            preemptions=stats.num_preemptions,
            context_iterations=stats.num_context_iterations,
        )
        self._set(
            self.general, iteration_counter=stats.num_iterations, timestamp=int(time.time() * 1e6)
        )
        self._set(
            self.steps,
            step_seconds=stats.step_seconds,
            device_wait_seconds=stats.device_wait_seconds,
            decode_streak_steps=stats.num_decode_streak_steps,
            decode_streak_seconds=stats.decode_streak_seconds,
        )
        self._set(
            self.spec_decode,
            num_drafts=stats.num_drafts,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_draft_tokens,
        )

    def observe_finished(self) -> None:
        while True:
            try:
                item = self._finished.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, str):  # refused in this stub: counted, nothing was served
                if item in self.rejected:
                    self.rejected[item].increment(1)
                continue
            self.input_len.observe(item.num_input_tokens)
            self.output_len.observe(item.num_output_tokens)
            if item.finish_reason in self.finished:
                self.finished[item.finish_reason].increment(1)
            if item.rejected in self.rejected:
                self.rejected[item.rejected].increment(1)
            if item.first_token_time:
                self.ttft.observe(max(0.0, item.first_token_time - item.arrival_time))
                if item.num_output_tokens > 1 and item.last_token_time:
                    self.itl.observe(
                        max(0.0, item.last_token_time - item.first_token_time)
                        / (item.num_output_tokens - 1)
                    )
            self.latency.observe(max(0.0, item.end_time - item.arrival_time))

    # ---- construction --------------------------------------------------------------------------
    def _gauges(self, name: str, description: str, label: str, values: tuple[str, ...]) -> dict:
        return self._labelled(name, description, label, values, pb_utils.MetricFamily.GAUGE)

    def _labelled(
        self, name: str, description: str, label: str, values: tuple[str, ...], kind
    ) -> dict:
        """One metric per value of `label`, in a family of `kind`."""
        family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(family)
        labels = self._labels if kind == pb_utils.MetricFamily.GAUGE else self._request_labels
        return {v: family.Metric(labels={**labels, label: v}) for v in values}

    def _histogram(self, name: str, description: str, labels: dict, buckets: list):
        family = pb_utils.MetricFamily(
            name=name, description=description, kind=pb_utils.MetricFamily.HISTOGRAM
        )
        self._families.append(family)
        return family.Metric(labels={**self._request_labels, **labels}, buckets=buckets)

    def _set(self, metrics: dict, **values) -> None:
        """Set gauges whose value changed: each set is an IPC round trip that holds the stub's
        interpreter lock (2.51's Metric.set does not release it)."""
        for key, value in values.items():
            gauge = metrics[key]
            if self._gauge_values.get(id(gauge)) != float(value):
                gauge.set(float(value))
                self._gauge_values[id(gauge)] = float(value)

"""The metrics endpoint exposes TensorRT-LLM's families, with values that match what was served."""

from __future__ import annotations

import time

import pytest

from tests.e2e.clients import grpc_request, metric, metrics

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello", "The capital of France is", "A long time ago in a galaxy far, far away,"]
MAX_TOKENS = [5, 9, 13]
LABELS = {
    "nv_trt_llm_request_metrics": (
        "request_type",
        ["active", "max", "scheduled", "context", "waiting"],
    ),
    "nv_trt_llm_kv_cache_block_metrics": (
        "kv_cache_block_type",
        ["max", "free", "used", "tokens_per", "reused", "fraction"],
    ),
    "nv_trt_llm_inflight_batcher_metrics": (
        "inflight_batcher_specific_metric",
        [
            "total_context_tokens",
            "generation_requests",
            "micro_batch_id",
            "preemptions",
            "context_iterations",
        ],
    ),
    "nv_trt_llm_general_metrics": ("general_type", ["iteration_counter", "timestamp"]),
    "nv_llm_engine_step_metrics": (
        "engine_step_metric",
        ["step_seconds", "device_wait_seconds", "decode_streak_steps", "decode_streak_seconds"],
    ),
}


def _delta(after, before, name, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def _quiet(triton) -> dict:
    """Metrics once no request runs and every finished one was observed (requests of earlier
    tests may still be ending)."""
    previous = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        samples = metrics(triton.metrics)
        idle = (
            metric(samples, "nv_trt_llm_request_metrics", request_type="active") == 0
            and metric(samples, "nv_trt_llm_request_metrics", request_type="waiting") == 0
        )
        count = metric(samples, "nv_llm_input_token_len_count")
        if idle and count == previous:
            return samples
        previous = count if idle else None
        time.sleep(0.5)
    raise AssertionError("the server did not become idle")


def _settled(triton, before, count: int) -> dict:
    """Metrics once `count` more requests were observed and the gauges show the engine idle
    (histograms and gauges update on short periods; gauges come from the engine process)."""
    deadline = time.monotonic() + 10
    while True:
        after = metrics(triton.metrics)
        observed = _delta(after, before, "nv_llm_input_token_len_count") >= count
        idle = (
            metric(after, "nv_trt_llm_request_metrics", request_type="active") == 0
            and metric(after, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used") == 0
        )
        if (observed and idle) or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def _published(triton) -> dict:
    """Metrics once the engine gauges have been set: they are refreshed every stats period, so
    a scrape right after the server is ready may still read zeros."""
    deadline = time.monotonic() + 10
    while True:
        samples = metrics(triton.metrics)
        try:
            stamp = metric(samples, "nv_trt_llm_general_metrics", general_type="timestamp")
        except KeyError:  # not registered yet
            stamp = 0
        if stamp > 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_families_and_labels(triton):
    samples = _published(triton)
    for family, (label, values) in LABELS.items():
        for value in values:
            metric(samples, family, model="tensorrt_llm", version="1", **{label: value})
    for family in (
        "nv_llm_input_token_len_count",
        "nv_llm_output_token_len_count",
        "nv_llm_time_to_first_token_seconds_count",
        "nv_llm_inter_token_latency_seconds_count",
    ):
        metric(samples, family, model="tensorrt_llm")
    s = triton.settings
    assert metric(samples, "nv_trt_llm_request_metrics", request_type="max") == s.max_batch_size
    assert (
        metric(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per")
        == s.tokens_per_block
    )
    assert (
        metric(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max")
        == s.max_tokens_in_paged_kv_cache // s.tokens_per_block
    )
    timestamp_us = metric(samples, "nv_trt_llm_general_metrics", general_type="timestamp")
    assert abs(timestamp_us / 1e6 - time.time()) < 60


def test_counts_match_what_was_served(triton, tokenizer):
    before = _quiet(triton)
    prompt_lengths, output_lengths = [], []
    for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
        ids = tokenizer.encode(prompt)
        result = grpc_request(
            triton.grpc,
            "tensorrt_llm",
            {
                "input_ids": ids,
                "input_lengths": len(ids),
                "request_output_len": max_tokens,
                "end_id": -1,
            },
        )
        assert result.error is None, result.error
        prompt_lengths.append(len(ids))
        output_lengths.append(len(result.ids()))
    assert output_lengths == MAX_TOKENS  # end id ignored: exact lengths
    after = _settled(triton, before, len(PROMPTS))

    assert _delta(after, before, "nv_llm_input_token_len_count") == len(PROMPTS)
    assert _delta(after, before, "nv_llm_input_token_len_sum") == sum(prompt_lengths)
    assert _delta(after, before, "nv_llm_input_token_len_bucket", le="10") == sum(
        n <= 10 for n in prompt_lengths
    )
    assert _delta(after, before, "nv_llm_output_token_len_count") == len(PROMPTS)
    assert _delta(after, before, "nv_llm_output_token_len_sum") == sum(output_lengths)
    assert _delta(after, before, "nv_llm_requests_finished_total", finish_reason="length") == len(
        PROMPTS
    )
    for family in (
        "nv_llm_time_to_first_token_seconds",
        "nv_llm_inter_token_latency_seconds",
        "nv_llm_request_latency_seconds",
    ):
        assert _delta(after, before, family + "_count") == len(PROMPTS)
        assert _delta(after, before, family + "_sum") > 0
    assert _delta(
        after, before, "nv_trt_llm_general_metrics", general_type="iteration_counter"
    ) >= max(MAX_TOKENS)
    step_s, wait_s = (
        _delta(after, before, "nv_llm_engine_step_metrics", engine_step_metric=m)
        for m in ("step_seconds", "device_wait_seconds")
    )
    assert step_s > wait_s >= 0
    # one request at a time: each computed its prompt in at least one step of its own
    assert _delta(
        after,
        before,
        "nv_trt_llm_inflight_batcher_metrics",
        inflight_batcher_specific_metric="context_iterations",
    ) >= len(PROMPTS)
    assert metric(after, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used") == 0
    assert metric(after, "nv_trt_llm_request_metrics", request_type="active") == 0


def test_prefix_reuse_is_reported(triton, tokenizer):
    """The same long prompt twice: the second reuses cached blocks, in its perf outputs and in
    the `reused` KV block gauge."""
    text = "System: you are a careful assistant who answers briefly. " * 4 + "User: hi"
    before = _quiet(triton)
    reused = []
    for _ in range(2):
        result = grpc_request(
            triton.grpc,
            "ensemble",
            {"text_input": text, "max_tokens": 2, "return_perf_metrics": True},
        )
        assert result.error is None, result.error
        reused.append(int(result.responses[-1]["kv_cache_reused_blocks"].reshape(-1)[0]))
    assert reused[1] >= len(tokenizer.encode(text)) // triton.settings.tokens_per_block - 1 > 0
    after = _settled(triton, before, 2)
    assert (
        _delta(after, before, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused")
        >= reused[1]
    )

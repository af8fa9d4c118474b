"""Overlap scheduling, forced on for CPU: the same tokens as the synchronous path and as
transformers, with every way a request can end while its next step is already queued."""

from __future__ import annotations

import threading

import pytest

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.engine.output_processor import OutputProcessor
from backend.engine.step import Engine
from backend.request import FinishReason, Request
from backend.runner.model_runner import ModelRunner
from backend.sampling.sampler import Sampler
from backend.sampling_params import SamplingParams
from backend.scheduling.scheduler import Scheduler
from tests.backend.test_executor import POISON, Collector
from tests.hf_reference import hf_greedy
from tests.tiny_models import TINY, TINY_CONFIGS, make_tiny_model, random_prompts
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-overlap")
    make_tiny_model("llama", path)
    return path


def executor_for(model_dir, overlap: bool, runner_class=ModelRunner, **config) -> Executor:
    config = EngineConfig(
        model_path=str(model_dir), device="cpu", overlap_scheduling=overlap, **config
    )
    executor = Executor(config, runner=runner_class(config))
    assert executor.overlap is overlap
    return executor


def serve(model_dir, prompts, params, overlap: bool = True, runner_class=ModelRunner, **config):
    executor = executor_for(model_dir, overlap, runner_class, **config)
    try:
        return executor.generate(prompts, params, timeout=300), executor.stats()
    finally:
        executor.shutdown()


def assert_all_blocks_free(stats):
    assert stats.kv.free_blocks == stats.kv.max_blocks


def test_overlap_is_off_on_cpu_by_default(tiny_dir):
    executor = Executor(EngineConfig(model_path=str(tiny_dir), device="cpu", tokens_per_block=8))
    try:
        assert executor.overlap is False
    finally:
        executor.shutdown()


def step_by_step(runner: ModelRunner, prompts, max_tokens: int, overlap: bool):
    """Drive `Engine.step` by hand (no executor thread) and record, after each step, every
    request's (real output ids, in-flight row). Returns the outputs, the record and the
    scheduler."""
    scheduler = Scheduler(runner.config, runner.num_kv_blocks, runner.tokens_per_block)
    outputs = OutputProcessor(
        runner.max_seq_len,
        runner.eos_token_ids,
        lambda request, reason, error: scheduler.finish(request),
    )
    engine = Engine(
        runner,
        Sampler(runner.vocab_size, runner.eos_token_ids),
        scheduler,
        outputs,
        threading.Lock(),
        overlap,
    )
    requests = [
        Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_end_id=True))
        for i, p in enumerate(prompts)
    ]
    for request in requests:
        scheduler.add(request)
        outputs.add(request, lambda out: None)
    record = []
    while scheduler.has_work() or engine.in_flight is not None:
        engine.step()
        record.append([(list(r.output_ids), r.in_flight_row) for r in requests])
    return [r.output_ids for r in requests], record, scheduler


def test_engine_step_keeps_one_token_per_request_in_flight(tiny_dir):
    """Overlap on: each step's tokens stay on the device (a row each, counted, in no id list)
    until the next step is queued; the tokens, and the number of model steps, are those of the
    synchronous engine, and every block is back in the pool at the end."""
    runner = ModelRunner(EngineConfig(model_path=str(tiny_dir), device="cpu", tokens_per_block=8))
    prompts = random_prompts(3, 512, seed=5, low=4, high=20)
    sync, sync_record, _ = step_by_step(runner, prompts, 5, overlap=False)
    tokens, record, scheduler = step_by_step(runner, prompts, 5, overlap=True)
    assert tokens == sync and all(len(t) == 5 for t in tokens)
    assert all(row is None for step in sync_record for _, row in step)
    assert record[0] == [([], 0), ([], 1), ([], 2)]  # prefill: all in flight
    assert record[1] == [
        ([t[0]], row) for row, t in enumerate(tokens)
    ]  # first real, next in flight
    assert record[-2] == [(t[:4], row) for row, t in enumerate(tokens)]  # the 5th: never computed
    assert record[-1] == [(t, None) for t in tokens]  # drained, not stepped
    assert len(record) - 1 == len(sync_record) == 5
    assert scheduler.kv.num_free_blocks == scheduler.total_blocks


class CountingRunner(ModelRunner):
    """Counts steps whose inputs came partly from the previous step's ids on the device."""

    overlapped = 0

    def execute(self, chunks, in_flight_ids=None, banned_ids=None, **options):
        if in_flight_ids is not None and any(c.request.in_flight_row is not None for c in chunks):
            CountingRunner.overlapped += 1
        return super().execute(chunks, in_flight_ids, banned_ids, **options)


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_overlap_matches_transformers(kind, tmp_path):
    hf = make_tiny_model(kind, tmp_path)
    prompts = random_prompts(12, TINY["vocab_size"], seed=len(kind))
    CountingRunner.overlapped = 0
    results, stats = serve(
        tmp_path,
        prompts,
        SamplingParams(max_tokens=12, ignore_end_id=True, return_log_probs=True),
        runner_class=CountingRunner,
        max_batch_size=16,
        max_num_tokens=256,
        tokens_per_block=8,
    )
    assert CountingRunner.overlapped >= 10  # the overlapped path ran
    for prompt, result in zip(prompts, results):
        expected, expected_logprobs = hf_greedy(hf, prompt, 12)
        assert result["token_ids"] == expected  # max_tokens exact, too
        assert result["logprobs"] == pytest.approx(expected_logprobs, abs=1e-4)
    assert_all_blocks_free(stats)
    assert stats.num_generated_tokens == 12 * len(prompts)


def test_overlap_chunked_prefill_prefix_reuse_and_preemption(tmp_path):
    hf = make_tiny_model("llama", tmp_path)
    prompts = random_prompts(16, TINY["vocab_size"], seed=7, low=20, high=120)
    prompts += [p[:40] + [5, 6, 7] for p in prompts[:4]]  # shared prefixes: reuse
    expected = [hf_greedy(hf, p, 16)[0] for p in prompts]
    params = SamplingParams(max_tokens=16, ignore_end_id=True)
    chunked, stats = serve(tmp_path, prompts, params, max_num_tokens=32, tokens_per_block=8)
    assert [r["token_ids"] for r in chunked] == expected
    assert_all_blocks_free(stats)
    preempting, stats = serve(
        tmp_path,
        prompts,
        params,
        max_num_tokens=256,
        tokens_per_block=8,
        max_tokens_in_paged_kv_cache=320,
        batch_scheduler_policy="max_utilization",
    )
    assert [r["token_ids"] for r in preempting] == expected
    assert stats.num_preemptions > 0
    assert_all_blocks_free(stats)


def mixed_params(free: list[list[int]]) -> list[SamplingParams]:
    """Every way to end, and every sampler feature, one request each (cycled over prompts)."""
    return [
        SamplingParams(max_tokens=20, ignore_end_id=True),
        SamplingParams(max_tokens=20, end_id=free[1][3]),  # end id
        SamplingParams(max_tokens=20, ignore_end_id=True, stop_token_ids=[free[2][4:6]]),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_end_id=True),
        SamplingParams(
            max_tokens=20,
            temperature=1.0,
            top_k=20,
            seed=5,
            return_log_probs=True,
            ignore_end_id=True,
        ),
        SamplingParams(max_tokens=20, repetition_penalty=1.3, ignore_end_id=True),  # drains
        SamplingParams(
            max_tokens=20, presence_penalty=0.5, frequency_penalty=0.3, ignore_end_id=True
        ),
        SamplingParams(
            max_tokens=20, bad_token_ids=[[free[7][2]], free[7][5:7]], ignore_end_id=True
        ),
        SamplingParams(max_tokens=20, min_tokens=6, end_id=free[8][1]),
        SamplingParams(
            max_tokens=7, embedding_bias={free[9][0]: -5.0, 17: 3.0}, ignore_end_id=True
        ),
        SamplingParams(max_tokens=1, ignore_end_id=True),
        SamplingParams(max_tokens=3, end_id=free[11][2], return_log_probs=True),
    ]


def test_overlap_gives_the_same_outputs_as_the_synchronous_path(tiny_dir):
    prompts = random_prompts(12, 512, seed=21, low=3, high=60)
    free, _ = serve(
        tiny_dir,
        prompts,
        SamplingParams(max_tokens=20, ignore_end_id=True),
        overlap=False,
        tokens_per_block=8,
    )
    free = [r["token_ids"] for r in free]
    params = mixed_params(free)
    config = dict(tokens_per_block=8, max_batch_size=8, max_num_tokens=64)  # chunked, staggered
    sync, sync_stats = serve(tiny_dir, prompts, params, overlap=False, **config)
    overlap, stats = serve(tiny_dir, prompts, params, overlap=True, **config)
    # Batches differ by the discarded extra steps, so float rounding may too: ids exact,
    # log-probs close.
    for a, b in zip(overlap, sync):
        assert (a["token_ids"], a["finish_reason"], a["error"]) == (
            b["token_ids"],
            b["finish_reason"],
            b["error"],
        )
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    assert [r["finish_reason"] for r in overlap[:3]] == [
        FinishReason.LENGTH,
        FinishReason.END_ID,
        FinishReason.STOP,
    ]
    assert len(overlap[10]["token_ids"]) == 1
    assert all(t >= 0 for r in overlap for t in r["token_ids"])  # only real ids are delivered
    assert stats.num_generated_tokens == sync_stats.num_generated_tokens
    assert_all_blocks_free(stats)


def test_end_id_and_stop_sequence_end_exactly_with_overlap(tiny_dir):
    executor = executor_for(tiny_dir, True, tokens_per_block=8, max_batch_size=8)
    try:
        prompt = [21, 22, 23]
        free = executor.generate([prompt], SamplingParams(max_tokens=12, ignore_end_id=True))[0][
            "token_ids"
        ]
        end = free[4]
        first = free.index(end)
        collector = Collector()
        executor.submit("end", prompt, SamplingParams(max_tokens=12, end_id=end), collector)
        final = collector.final
        # The step after the end id was already queued; its token is never delivered.
        assert final.finish_reason == FinishReason.END_ID
        assert collector.tokens == free[:first] and final.num_output_tokens == first
        stop = free[6:8]
        collector = Collector()
        executor.submit(
            "stop",
            prompt,
            SamplingParams(max_tokens=12, ignore_end_id=True, stop_token_ids=[stop]),
            collector,
        )
        assert collector.final.finish_reason == FinishReason.STOP
        at = next(i for i in range(len(free)) if free[i : i + 2] == stop)
        assert collector.tokens == free[:at]
        assert_all_blocks_free(executor.stats())
    finally:
        executor.shutdown()


def test_min_tokens_counts_the_token_in_flight(tiny_dir):
    """The min-tokens end ban is decided while the previous token is still on the device: it
    counts, so the end id is allowed exactly from the min_tokens-th output on."""
    executor = executor_for(tiny_dir, True, tokens_per_block=8, max_batch_size=8)
    try:
        prompt = [9, 8, 7]
        free = executor.generate([prompt], SamplingParams(max_tokens=12, ignore_end_id=True))[0][
            "token_ids"
        ]
        at = next(i for i in range(2, 12) if free[i] not in free[:i])
        result = executor.generate(
            [prompt], SamplingParams(max_tokens=12, min_tokens=at, end_id=free[at])
        )[0]
        assert result["finish_reason"] == FinishReason.END_ID and result["token_ids"] == free[:at]
    finally:
        executor.shutdown()


def test_cancel_with_overlap_delivers_real_tokens_and_frees_blocks(tiny_dir):
    executor = executor_for(tiny_dir, True, tokens_per_block=8, max_batch_size=8)
    try:
        prompt = [3, 4, 5, 6]
        free = executor.generate([prompt], SamplingParams(max_tokens=150, ignore_end_id=True))[0][
            "token_ids"
        ]
        collector = Collector()
        executor.submit(
            "long", prompt, SamplingParams(max_tokens=150, ignore_end_id=True), collector
        )
        wait_until(lambda: len(collector.outputs) >= 3, "three outputs", poll_s=0)
        assert executor.cancel("long")
        final = collector.final
        assert final.finish_reason == FinishReason.CANCELLED
        tokens = collector.tokens
        assert len(tokens) < 150 and tokens == free[: len(tokens)]  # a prefix of real tokens
        stats = executor.stats()
        assert_all_blocks_free(stats)
        assert stats.num_cancelled == 1
        # The executor keeps serving afterwards.
        again = executor.generate([prompt], SamplingParams(max_tokens=150, ignore_end_id=True))[0]
        assert again["token_ids"] == free
    finally:
        executor.shutdown()


class PoisonedRunner(ModelRunner):
    def execute(self, chunks, in_flight_ids=None, banned_ids=None, **options):
        if any(POISON in c.request.tokens(c.start, c.start + c.num_tokens) for c in chunks):
            raise RuntimeError("poisoned step")
        return super().execute(chunks, in_flight_ids, banned_ids, **options)


def test_a_failing_request_fails_alone_with_overlap(tiny_dir):
    prompts = [[t for t in p if t != POISON] for p in random_prompts(6, 512, seed=3)]
    params = SamplingParams(max_tokens=8, ignore_end_id=True)
    expected, _ = serve(tiny_dir, prompts, params, overlap=False, tokens_per_block=8)
    executor = executor_for(tiny_dir, True, PoisonedRunner, tokens_per_block=8)
    try:
        bad = Collector()
        executor.submit("poisoned", [3, POISON, 4], SamplingParams(max_tokens=8), bad)
        results = executor.generate(prompts, params)
        assert bad.final.finish_reason == FinishReason.ERROR and bad.final.error
        assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expected]
        assert_all_blocks_free(executor.stats())
    finally:
        executor.shutdown()

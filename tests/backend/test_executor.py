"""Executor behaviour on a tiny random model: validation, cancellation, stop sequences, queue
limits, failure isolation, and the offline command."""

from __future__ import annotations

import gc
import json
import threading
import weakref

import pytest

from backend import generate
from backend.config import EngineConfig
from backend.engine.executor import Executor, QueueFullError
from backend.engine.step_runner import StepRunner
from backend.request import FinishReason
from backend.runner.model_runner import ModelRunner
from backend.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts
from tests.waiting import wait_until

POISON = 7  # prompts containing this token make the faulty runner below raise


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", path)
    return path


def tiny_config(tiny_dir, **settings) -> EngineConfig:
    return EngineConfig(model_path=str(tiny_dir), device="cpu", tokens_per_block=8, **settings)


@pytest.fixture
def executor(tiny_dir):
    ex = Executor(tiny_config(tiny_dir, max_seq_len=256, max_batch_size=8))
    yield ex
    ex.shutdown()


class Collector:
    def __init__(self):
        self.outputs = []
        self.done = threading.Event()

    def __call__(self, out):
        self.outputs.append(out)
        if out.finished:
            self.done.set()

    @property
    def tokens(self):
        return [t for o in self.outputs for t in o.new_token_ids]

    @property
    def final(self):
        assert self.done.wait(60)
        return self.outputs[-1]


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(max_tokens=4), "prompt must not be empty"),
        ([5] * 300, SamplingParams(max_tokens=4), "max_seq_len"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
        ([5, 6], SamplingParams(max_tokens=-3), "max_tokens must be >= 1"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        ([5, 6], SamplingParams(temperature=-1.0), "temperature must be >= 0"),
        ([5, 600], SamplingParams(), "prompt token ids must be integers in [0, 512)"),
        ([5, 6], SamplingParams(stop_token_ids=[[]]), "stop_token_ids"),
        ([5, 6], SamplingParams(bad_token_ids=[[9999]]), "bad_token_ids"),
    ],
)
def test_bad_input_is_rejected_and_neighbours_are_served(executor, prompt, params, message):
    good = Collector()
    executor.submit("good", [3, 4, 5], SamplingParams(max_tokens=6, ignore_end_id=True), good)
    with pytest.raises(ValueError) as err:
        executor.submit("bad", prompt, params, Collector())
    assert message in str(err.value)
    assert good.final.finish_reason == FinishReason.LENGTH
    assert len(good.tokens) == 6


def test_generate_refuses_a_bad_prompt_before_queueing_any_and_batches_the_rest(tiny_dir):
    """generate validates every prompt first (a bad one queues none of them), then queues them
    together: prompts that fit the step's budget run as one prompt step."""
    ex = Executor(tiny_config(tiny_dir, max_seq_len=256, max_num_tokens=64, max_batch_size=8))
    try:
        with pytest.raises(ValueError, match="prompt must not be empty"):
            ex.generate([[3, 4, 5], []], SamplingParams(max_tokens=2))
        assert ex.stats().num_iterations == 0  # the good prompt never ran
        ex.generate(random_prompts(4, 500, seed=2, low=10, high=16), SamplingParams(max_tokens=1))
        assert ex.stats().num_context_iterations == 1
    finally:
        ex.shutdown()


def test_context_iterations_count_the_steps_that_compute_a_prompt(tiny_dir):
    """A 40-token prompt in chunks of at most 16 tokens takes three prompt steps; its four later
    tokens come from decode steps, which are not counted. Three of those follow a decode step
    (steady decode steps), and the step thread's time is split into waits and the rest."""
    ex = Executor(tiny_config(tiny_dir, max_seq_len=256, max_num_tokens=16))
    try:
        ex.generate([list(range(3, 43))], SamplingParams(max_tokens=5, ignore_end_id=True))
        stats = ex.stats()
    finally:
        ex.shutdown()
    assert stats.num_context_iterations == 3
    assert stats.num_iterations == 3 + 4
    assert stats.num_decode_streak_steps == 3
    assert 0 < stats.decode_streak_seconds < stats.step_seconds
    assert 0 <= stats.device_wait_seconds < stats.step_seconds


def test_the_model_runner_is_what_the_engine_needs_of_a_runner(executor):
    assert isinstance(executor.runner, ModelRunner) and isinstance(executor.runner, StepRunner)


def test_cancel_frees_blocks_and_sends_final(executor):
    collector = Collector()
    executor.submit(
        "long", [3, 4, 5, 6], SamplingParams(max_tokens=200, ignore_end_id=True), collector
    )
    wait_until(lambda: collector.outputs, "the long request's first output", poll_s=0)
    assert executor.cancel("long")
    final = collector.final
    assert final.finished and final.finish_reason == FinishReason.CANCELLED
    assert len(collector.tokens) < 200
    stats = executor.stats()
    assert stats.kv.free_blocks == stats.kv.max_blocks and stats.num_cancelled == 1
    assert not executor.cancel("long")  # already gone


def test_idle_stats_after_requests(executor):
    executor.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=5, ignore_end_id=True))
    stats = executor.stats()
    assert (
        stats.num_completed == 2 and stats.num_generated_tokens == 10 and stats.num_iterations >= 5
    )
    assert (
        stats.num_running,
        stats.num_waiting,
        stats.last_num_scheduled_tokens,
        stats.last_num_context_requests,
        stats.last_num_generation_requests,
    ) == (0, 0, 0, 0, 0)
    assert stats.kv.free_blocks == stats.kv.max_blocks


def test_stop_sequence_ends_where_the_stop_starts(executor):
    prompt = [11, 12, 13, 14]
    free = executor.generate([prompt], SamplingParams(max_tokens=20, ignore_end_id=True))[0][
        "token_ids"
    ]
    stop = free[5:8]
    collector = Collector()
    executor.submit(
        "stop",
        prompt,
        SamplingParams(max_tokens=20, ignore_end_id=True, stop_token_ids=[stop]),
        collector,
    )
    assert collector.final.finish_reason == FinishReason.STOP
    # The first occurrence of the stop sequence ends generation; nothing of it is delivered.
    first = next(i for i in range(len(free)) if free[i : i + len(stop)] == stop)
    assert collector.tokens == free[:first]


def test_end_id_finishes_and_is_not_delivered(executor):
    prompt = [21, 22, 23]
    free = executor.generate([prompt], SamplingParams(max_tokens=10, ignore_end_id=True))[0]
    end = free["token_ids"][4]
    result = executor.generate([prompt], SamplingParams(max_tokens=10, end_id=end))[0]
    first = free["token_ids"].index(end)
    assert result["finish_reason"] == FinishReason.END_ID
    assert result["token_ids"] == free["token_ids"][:first]


def test_queue_full_is_refused_explicitly(tiny_dir):
    ex = Executor(tiny_config(tiny_dir, max_batch_size=1, max_queue_size=1))
    try:
        first, second = Collector(), Collector()
        ex.submit("a", [3, 4], SamplingParams(max_tokens=100, ignore_end_id=True), first)
        wait_until(lambda: first.outputs, "the first request's first output", poll_s=0)
        ex.submit("b", [3, 4], SamplingParams(max_tokens=2), second)
        with pytest.raises(QueueFullError, match="max_queue_size=1"):
            ex.submit("c", [3, 4], SamplingParams(max_tokens=2), Collector())
        assert first.final.finish_reason == FinishReason.LENGTH
        assert second.final.finish_reason in (FinishReason.LENGTH, FinishReason.END_ID)
    finally:
        ex.shutdown()


class PoisonedRunner(ModelRunner):
    """The real runner, failing whenever a poison token is in the step (fault injection)."""

    def execute(self, chunks, in_flight_ids=None, banned_ids=None, **options):
        if any(POISON in c.request.tokens(c.start, c.start + c.num_tokens) for c in chunks):
            raise RuntimeError("poisoned step")
        return super().execute(chunks, in_flight_ids, banned_ids, **options)


def test_a_failing_request_fails_alone(tiny_dir):
    config = tiny_config(tiny_dir)
    clean = Executor(config)
    prompts = random_prompts(6, 512, seed=3)
    prompts = [[t for t in p if t != POISON] for p in prompts]
    expected = clean.generate(prompts, SamplingParams(max_tokens=8, ignore_end_id=True))
    clean.shutdown()

    ex = Executor(config, runner=PoisonedRunner(config))
    try:
        bad = Collector()
        ex.submit("poisoned", [3, POISON, 4], SamplingParams(max_tokens=8), bad)
        results = ex.generate(prompts, SamplingParams(max_tokens=8, ignore_end_id=True))
        assert bad.final.finish_reason == FinishReason.ERROR and bad.final.error
        assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expected]
    finally:
        ex.shutdown()


def test_a_request_failing_in_a_prefill_chunk_that_does_not_sample_fails(tiny_dir):
    """Its KV for that chunk was never written: it must not go on to sample from it."""
    config = tiny_config(
        tiny_dir,
        max_num_tokens=8,
        enable_chunked_context=True,
    )
    ex = Executor(config, runner=PoisonedRunner(config))
    try:
        bad = Collector()
        ex.submit("poisoned", [3, 4, POISON] + [5] * 20, SamplingParams(max_tokens=4), bad)
        assert bad.final.finish_reason == FinishReason.ERROR and bad.tokens == []
        good = ex.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_end_id=True))[0]
        assert good["finish_reason"] == FinishReason.LENGTH and len(good["token_ids"]) == 4
        assert ex.stats().kv.free_blocks == ex.stats().kv.max_blocks
    finally:
        ex.shutdown()


def test_a_failing_callback_fails_alone(executor):
    def explode(out):
        raise RuntimeError("client went away")

    executor.submit(
        "exploding", [3, 4, 5], SamplingParams(max_tokens=50, ignore_end_id=True), explode
    )
    result = executor.generate([[3, 4, 5]], SamplingParams(max_tokens=5, ignore_end_id=True))[0]
    assert len(result["token_ids"]) == 5
    stats = executor.stats()
    assert stats.num_failed == 1


def test_offline_command_unknown_model(tiny_dir, capsys):
    code = generate.main(["--model", str(tiny_dir / "missing"), "--prompt", "hi"])
    assert code == 2
    assert "expected" in capsys.readouterr().err


def test_offline_command_takes_every_engine_option(tiny_dir, capsys):
    """Each EngineConfig field is a flag of `python -m backend.generate` (the engine's seed is
    its sampling --seed), and a value given reaches the engine; a bad one is refused by name."""
    from dataclasses import fields

    from backend.config import EngineConfig

    option_names = {a.dest for a in generate.build_parser()._actions}
    assert {f.name for f in fields(EngineConfig)} <= option_names
    args = generate.parse_args(
        [
            "--model",
            str(tiny_dir),
            "--prompt",
            "hi",
            "--max-seq-len",
            "96",
            "--long-prefill-token-threshold",
            "8",
            "--enable-kv-cache-reuse",
            "false",
        ]
    )
    config = generate.engine_config(args)
    assert (config.max_seq_len, config.long_prefill_token_threshold) == (96, 8)
    assert config.enable_kv_cache_reuse is False and config.model_path == str(tiny_dir)
    code = generate.main(["--model", str(tiny_dir), "--prompt", "hi", "--quantization", "int3"])
    assert code == 2 and "quantization must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_offline_command_default_model(capsys):
    code = generate.main(
        [
            "--prompt",
            "The capital of France is",
            "--prompt",
            "Say hi",
            "--chat",
            "--max-tokens",
            "8",
            "--json",
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["The capital of France is", "Say hi"]
    for line in lines:
        assert 0 < len(line["token_ids"]) <= 8 and isinstance(line["text"], str) and line["text"]


def test_shutdown_frees_the_model_and_kv_cache_at_once(tiny_dir):
    """Shutdown hands the runner's memory back without waiting for the garbage collector to find
    the engine's reference cycles (on a GPU, a benchmark's next model needs that memory)."""
    ex = Executor(tiny_config(tiny_dir, max_seq_len=256))
    assert ex.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]["error"] is None
    kv_cache, weight = (
        weakref.ref(ex.runner.kv_cache),
        weakref.ref(next(ex.runner.model.parameters())),
    )
    gc.disable()
    try:
        ex.shutdown()
        assert kv_cache() is None and weight() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("interval", [3, 4])
def test_stream_interval_gives_the_same_tokens_in_fewer_outputs(tiny_dir, interval):
    def run(stream_interval, params):
        ex = Executor(tiny_config(tiny_dir, max_seq_len=256, stream_interval=stream_interval))
        try:
            collectors = [Collector(), Collector()]
            for i, (prompt, c) in enumerate(zip([[3, 4, 5], [6, 7, 8, 9]], collectors)):
                ex.submit(f"r{i}", prompt, params, c)
            return [(c.final, [o.new_token_ids for o in c.outputs], c.tokens) for c in collectors]
        finally:
            ex.shutdown()

    params = SamplingParams(max_tokens=11, ignore_end_id=True)
    every = run(1, params)
    paced = run(interval, params)
    for (final, pieces, tokens), (final_1, pieces_1, tokens_1) in zip(paced, every):
        assert tokens == tokens_1 and len(tokens) == 11
        assert pieces_1 == [[t] for t in tokens_1]
        assert pieces[0] == tokens[:1]  # the first token is not held back
        assert all(len(p) >= interval for p in pieces[1:-1]) and 0 < len(pieces[-1])
        assert len(pieces) < len(pieces_1) and final.finished and final_1.finished
    # A stop sequence still ends the text where it starts, whatever was held back.
    stop = every[0][2][6:8]
    stopped = run(
        interval, SamplingParams(max_tokens=11, ignore_end_id=True, stop_token_ids=[stop])
    )
    assert stopped[0][0].finish_reason == FinishReason.STOP
    free = every[0][2]
    first = next(i for i in range(len(free)) if free[i : i + 2] == stop)
    assert stopped[0][2] == free[:first]


def test_stream_interval_is_checked():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)

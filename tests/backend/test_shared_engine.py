"""One engine process driven by several handles (`EngineProcess.shared`): what several Triton
instances of the LLM model do."""

from __future__ import annotations

import os
import signal
import threading
import uuid

import pytest

from backend.engine.executor import Executor
from backend.process.client import EngineProcess
from backend.request import FinishReason
from backend.sampling_params import SamplingParams
from tests.backend.test_engine_process import Outputs, config_for
from tests.tiny_models import make_tiny_model, random_prompts
from tests.waiting import wait_until

LONG = SamplingParams(max_tokens=240, ignore_end_id=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-shared")
    make_tiny_model("llama", path)
    return path


def unique_name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def first_token(outputs: Outputs) -> None:
    wait_until(lambda: outputs.items, "the first token")


def test_handles_started_together_share_one_engine_and_get_its_exact_outputs(tiny_dir):
    config, name = config_for(tiny_dir), unique_name()
    handles: list[EngineProcess] = []
    threads = [
        threading.Thread(target=lambda: handles.append(EngineProcess.shared(config, name)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert len(handles) == 3
        assert sum(h.owner for h in handles) == 1, "exactly one handle starts the engine"
        assert len({h.info.pid for h in handles}) == 1
        prompts = random_prompts(6, 512, seed=11)
        params = [SamplingParams(max_tokens=9, ignore_end_id=True)] * 6
        executor = Executor(config)
        try:
            expected = executor.generate(prompts, params)
        finally:
            executor.shutdown()
        collected = [Outputs() for _ in prompts]
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            handles[i % 3].submit(f"row-{i}", prompt, p, collected[i])
        for outputs, result in zip(collected, expected):
            assert outputs.wait().finish_reason == FinishReason.LENGTH
            assert outputs.token_ids == result["token_ids"]
        for handle in handles:  # each gets the engine's statistics
            wait_until(
                lambda h=handle: h.stats() and h.stats().num_completed >= len(prompts),
                "every request completed",
            )
    finally:
        owner = next(h for h in handles if h.owner)
        for handle in handles:
            handle.shutdown()
    # the last handle's detach ends it
    wait_until(lambda: owner.process.poll() is not None, "the engine process to exit")
    assert owner.process.returncode == 0


def test_the_engine_outlives_its_starter_and_exits_after_the_last_handle(tiny_dir):
    """A handle that detaches has its own requests cancelled (their blocks go back) and leaves
    the others' running; the engine exits once no handle is left."""
    config, name = config_for(tiny_dir), unique_name()
    starter = EngineProcess.shared(config, name)
    other = EngineProcess.shared(config, name)
    assert starter.owner and not other.owner
    mine, theirs = Outputs(), Outputs()
    starter.submit("mine", [3, 4, 5], LONG, mine)
    other.submit("theirs", [6, 7, 8], LONG, theirs)
    first_token(mine)
    first_token(theirs)
    starter.shutdown()
    assert mine.wait(10).finish_reason == FinishReason.ERROR and "shut down" in mine.wait().error
    assert starter.process.poll() is None, "another handle still drives it"
    final = theirs.wait(120)
    assert final.finish_reason == FinishReason.LENGTH and len(theirs.token_ids) == 240
    wait_until(
        lambda: other.stats().num_cancelled == 1 and other.stats().kv.used_blocks == 0,
        "the cancelled request's blocks freed",
    )
    late = Outputs()  # a handle attached after the starter left still gets its requests served
    third = EngineProcess.shared(config, name)
    assert not third.owner
    third.submit("late", [9, 10], SamplingParams(max_tokens=3, ignore_end_id=True), late)
    assert late.wait().finish_reason == FinishReason.LENGTH
    third.shutdown()
    other.shutdown()
    wait_until(lambda: starter.process.poll() is not None, "the engine process to exit")
    assert starter.process.returncode == 0


def test_a_stop_reaches_the_other_handles(tiny_dir):
    config, name = config_for(tiny_dir), unique_name()
    a = EngineProcess.shared(config, name)
    b = EngineProcess.shared(config, name)
    try:
        asked = []
        a.on_stop_user = asked.append
        b.on_stop_user = lambda user_id: pytest.fail("the sender is not told its own stop")
        b.stop_user("client-7")
        wait_until(lambda: asked == ["client-7"], "the client's request")
    finally:
        b.shutdown()
        a.shutdown()


def test_a_handle_with_another_configuration_is_refused(tiny_dir):
    name = unique_name()
    running = EngineProcess.shared(config_for(tiny_dir), name)
    try:
        with pytest.raises(RuntimeError, match=r"another configuration.*max_batch_size=4"):
            EngineProcess.shared(config_for(tiny_dir, max_batch_size=4), name)
        outputs = Outputs()  # the running engine is not disturbed
        running.submit("still", [3, 4], SamplingParams(max_tokens=2, ignore_end_id=True), outputs)
        assert outputs.wait().finish_reason == FinishReason.LENGTH
    finally:
        running.shutdown()


def test_a_failed_start_is_reported_to_every_handle_that_waited(tmp_path):
    config, name = config_for(tmp_path / "missing"), unique_name()
    errors: list[Exception] = []

    def start():
        try:
            EngineProcess.shared(config, name)
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(errors) == 2 and all("engine failed to start" in str(e) for e in errors)


def test_a_killed_engine_fails_the_requests_of_every_handle(tiny_dir):
    config, name = config_for(tiny_dir), unique_name()
    starter = EngineProcess.shared(config, name)
    other = EngineProcess.shared(config, name)
    try:
        outputs = Outputs()
        other.submit("doomed", [3, 4, 5], LONG, outputs)
        first_token(outputs)
        os.kill(starter.info.pid, signal.SIGKILL)
        final = outputs.wait(10)
        assert final.finish_reason == FinishReason.ERROR and "engine process exited" in final.error
        with pytest.raises(RuntimeError, match="engine process exited"):
            other.submit("late", [3, 4], SamplingParams(max_tokens=2), Outputs())
    finally:
        other.shutdown()
        starter.shutdown()

"""The engine in a process of its own (backend/process/service.py), driven like an Executor
through its handle (backend/process/client.py), by one client or several."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.process.client import EngineProcess
from backend.process.outbox import MIDDLE_FIELDS, Outbox, output_values
from backend.request import FinishReason, RequestOutput
from backend.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-process")
    make_tiny_model("llama", path)
    return path


def config_for(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(
        **{
            "model_path": str(model_dir),
            "device": "cpu",
            "max_seq_len": 256,
            "tokens_per_block": 8,
            "max_batch_size": 8,
            **overrides,
        }
    )


class Outputs:
    """Collects one request's outputs; `wait()` until its final one."""

    def __init__(self):
        self.items: list[RequestOutput] = []
        self.done = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        self.items.append(out)
        if out.finished:
            self.done.set()

    def wait(self, timeout: float = 60.0) -> RequestOutput:
        assert self.done.wait(timeout), "no final output"
        return self.items[-1]

    @property
    def token_ids(self) -> list[int]:
        return [t for out in self.items for t in out.new_token_ids]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    process = EngineProcess(config_for(tiny_dir))
    yield process
    process.shutdown()


def test_outputs_through_the_process_equal_the_executors(tiny_dir, engine):
    prompts = random_prompts(6, 512, seed=5)
    params = [
        SamplingParams(max_tokens=10, ignore_end_id=True),
        SamplingParams(max_tokens=7, temperature=0.9, top_p=0.9, seed=3, return_log_probs=True),
    ] * 3
    executor = Executor(config_for(tiny_dir))
    try:
        expected = executor.generate(prompts, params)
    finally:
        executor.shutdown()
    collected = [Outputs() for _ in prompts]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.submit(f"same-{i}", prompt, p, collected[i])
    for outputs, result in zip(collected, expected):
        final = outputs.wait()
        assert outputs.token_ids == result["token_ids"]
        assert [x for o in outputs.items for x in o.new_logprobs] == pytest.approx(
            result["logprobs"]
        )
        assert final.finish_reason == result["finish_reason"]
    assert engine.vocab_size == executor.vocab_size and engine.max_seq_len == executor.max_seq_len
    deadline = time.monotonic() + 5

    def completed() -> int:
        stats = engine.stats()  # None until the first statistics have come
        return -1 if stats is None else stats.num_completed

    while completed() < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.05)  # statistics come every STATS_PERIOD_S
    assert completed() >= len(prompts)


def test_a_streams_middle_outputs_travel_short_and_arrive_whole(engine):
    """Between a stream's first and last output only the changing fields travel; the handle
    gives each output the request's other fields as the first output had them."""
    first = RequestOutput("r", [4], [], 1, False, None, None, 9, 0, 2, 0.0, 1.0, 2.0, 3.0, 3.0)
    middle = dataclasses.replace(first, new_token_ids=[5], num_output_tokens=2, last_token_time=4.0)
    assert len(output_values(first)) == len(dataclasses.fields(RequestOutput))
    assert len(output_values(middle)) == len(MIDDLE_FIELDS)

    prompt = random_prompts(1, 512, seed=7)[0]
    outputs = Outputs()
    engine.submit("short", prompt, SamplingParams(max_tokens=6, ignore_end_id=True), outputs)
    outputs.wait()
    head = outputs.items[0]
    assert len(outputs.items) == 6 and head.first_token_time is not None
    for n, out in enumerate(outputs.items, start=1):
        assert out.num_output_tokens == n and len(out.new_token_ids) == 1
        assert out.num_prompt_tokens == len(prompt)
        assert (out.arrival_time, out.first_scheduled_time, out.first_token_time) == (
            head.arrival_time,
            head.first_scheduled_time,
            head.first_token_time,
        )
        assert out.last_token_time >= head.first_token_time
    assert [o.finished for o in outputs.items] == [False] * 5 + [True]


def test_bad_input_is_refused_at_once_with_the_executors_message(engine):
    with pytest.raises(ValueError, match=r"must be shorter than max_seq_len \(256\)"):
        engine.submit("long", [5] * 300, SamplingParams(max_tokens=4), Outputs())
    with pytest.raises(ValueError, match="prompt token ids must be integers in"):
        engine.submit("oov", [5, 10**9], SamplingParams(max_tokens=4), Outputs())


def test_a_full_queue_comes_back_as_a_rejected_output(tiny_dir):
    """max_queue_size 1 and max_batch_size 2: of ten long requests sent at once, those that find
    one waiting already are refused (at most two run and one waits in the time it takes)."""
    process = EngineProcess(config_for(tiny_dir, max_queue_size=1, max_batch_size=2))
    try:
        collected = [Outputs() for _ in range(10)]
        for i, outputs in enumerate(collected):
            process.submit(
                f"queue-{i}", [3, 4, 5], SamplingParams(max_tokens=200, ignore_end_id=True), outputs
            )
        finals = [o.wait() for o in collected]
    finally:
        process.shutdown()
    rejected = [f for f in finals if f.rejected]
    assert len(rejected) >= 7 and all(
        r.rejected == "queue_full"
        and r.finish_reason == FinishReason.ERROR
        and "Exceeds maximum queue size" in r.error
        for r in rejected
    )
    assert sum(f.finish_reason == FinishReason.LENGTH for f in finals) == len(finals) - len(
        rejected
    )


def test_cancel_ends_a_request_as_cancelled(engine):
    outputs = Outputs()
    engine.submit(
        "cancel-me", [3, 4, 5], SamplingParams(max_tokens=250, ignore_end_id=True), outputs
    )
    wait_until(lambda: outputs.items, "the first token")
    assert engine.cancel("cancel-me")
    assert outputs.wait().finish_reason == FinishReason.CANCELLED
    assert not engine.cancel("cancel-me")  # no longer in flight


def test_a_dead_engine_fails_its_requests_and_refuses_new_ones(tiny_dir):
    process = EngineProcess(config_for(tiny_dir))
    try:
        outputs = Outputs()
        process.submit(
            "doomed", [3, 4, 5], SamplingParams(max_tokens=250, ignore_end_id=True), outputs
        )
        os.kill(process.process.pid, signal.SIGKILL)
        final = outputs.wait(timeout=10)
        assert final.finish_reason == FinishReason.ERROR and "engine process exited" in final.error
        with pytest.raises(RuntimeError, match="engine process exited"):
            process.submit("late", [3, 4], SamplingParams(max_tokens=2), Outputs())
    finally:
        process.shutdown()


def test_a_model_that_cannot_load_fails_the_start_with_its_error(tmp_path):
    with pytest.raises(RuntimeError, match="engine failed to start"):
        EngineProcess(config_for(tmp_path / "missing"))


def test_a_handle_without_a_receiver_thread_delivers_in_its_callers_pump(tiny_dir):
    """`receiver_thread=False` (the Triton model's response thread reads the outputs itself):
    the callbacks run inside `pump`, in the calling thread, with the same tokens; when the
    engine dies, `pump` delivers the errors of the requests in flight and returns False."""
    prompt = random_prompts(1, 512, seed=11)[0]
    greedy = SamplingParams(max_tokens=12, ignore_end_id=True)
    reference = Executor(config_for(tiny_dir))
    try:
        expected = reference.generate([prompt], greedy)[0]["token_ids"]
    finally:
        reference.shutdown()
    process = EngineProcess(config_for(tiny_dir), receiver_thread=False)
    try:
        threads, outputs = set(), Outputs()

        def on_output(out: RequestOutput) -> None:
            threads.add(threading.get_ident())
            outputs(out)

        process.submit("pumped", prompt, greedy, on_output)
        deadline = time.monotonic() + 60
        while not outputs.done.is_set():
            assert time.monotonic() < deadline, "timed out waiting for the pumped request"
            assert process.pump(0.1)
        assert outputs.token_ids == expected
        assert threads == {threading.get_ident()}
        doomed = Outputs()
        process.submit("doomed", prompt, SamplingParams(max_tokens=250, ignore_end_id=True), doomed)
        os.kill(process.process.pid, signal.SIGKILL)
        while process.pump(0.1):
            assert time.monotonic() < deadline, "pump went on delivering after the engine died"
        assert not process.pump(0.0)
        assert doomed.wait(timeout=1).finish_reason == FinishReason.ERROR
    finally:
        process.shutdown()


def test_outputs_travel_as_tuples_of_every_field():
    ours, theirs = socket.socketpair()
    conn, client = Connection(ours.detach()), Connection(theirs.detach())
    outbox = Outbox(executor=type("Idle", (), {"stats": lambda self: None})())
    outbox.add(conn)
    out = RequestOutput(
        "r",
        [1, 2],
        [-0.5, -0.25],
        2,
        True,
        FinishReason.STOP,
        "e",
        3,
        1,
        2,
        -0.75,
        1.0,
        2.0,
        3.0,
        4.0,
        "invalid",
    )
    outbox.track(conn, "r")(out)  # what the executor thread calls
    outbox.flush()  # what it calls at the end of each pass of its loop
    messages = []
    while client.poll(5):
        messages.append(client.recv())
        if messages[-1][0] == "outputs":
            break
    outbox.close()
    values = next(m[1] for m in messages if m[0] == "outputs")[0]
    assert RequestOutput(*values) == out
    assert len(values) == len(dataclasses.fields(RequestOutput))


def test_a_removed_client_gets_its_outputs_then_the_farewell_then_eof():
    ours, theirs = socket.socketpair()
    conn, client = Connection(ours.detach()), Connection(theirs.detach())
    outbox = Outbox(executor=type("Idle", (), {"stats": lambda self: None})())
    outbox.add(conn)
    done = RequestOutput("a", [7], [], 1, True, FinishReason.LENGTH)
    outbox.track(conn, "a")(done)
    outbox.track(conn, "b")
    assert outbox.remove(conn, ("detached", 0)) == {"b"}  # "a" ended; "b" is still in flight
    kinds = []
    try:
        while client.poll(5):
            message = client.recv()
            kinds.append(message[0])
            if message[0] == "outputs":
                assert RequestOutput(*message[1][0]) == done
    except EOFError:
        kinds.append("eof")
    outbox.close()
    assert [k for k in kinds if k != "stats"] == ["outputs", "detached", "eof"]


def test_a_client_that_reads_late_gets_every_message_in_order_and_never_stalls_a_flush():
    """Far more than the socket holds, flushed while the client reads nothing: each flush
    returns at once (what does not fit goes to the writer thread, partial messages included),
    and the client then reads every output whole and in order."""
    ours, theirs = socket.socketpair()
    conn, client = Connection(ours.detach()), Connection(theirs.detach())
    outbox = Outbox(executor=type("Idle", (), {"stats": lambda self: None})())
    outbox.add(conn)
    sent = [RequestOutput(f"r{i}", list(range(i, i + 5000)), [], i, False) for i in range(200)]

    def flush_all():
        for out in sent:
            outbox.track(conn, out.request_id)(out)
            outbox.flush()

    flusher = threading.Thread(target=flush_all)
    flusher.start()
    flusher.join(timeout=30)
    assert not flusher.is_alive(), "a flush waited for the client"
    received = []
    while len(received) < len(sent) and client.poll(10):
        message = client.recv()
        if message[0] == "outputs":
            received += [RequestOutput(*values) for values in message[1]]
    outbox.close()
    assert received == sent


def test_sigterm_drains_the_engine(tiny_dir):
    """A server being stopped: requests in flight end at once, refused as "shutting_down", and
    so is every later submit; the process then waits for its handle's stop."""
    process = EngineProcess(config_for(tiny_dir))
    try:
        running = Outputs()
        process.submit(
            "long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_end_id=True), running
        )
        wait_until(lambda: running.items, "the first token")
        os.kill(process.process.pid, signal.SIGTERM)
        final = running.wait(timeout=10)
        assert final.rejected == "shutting_down" and "shutting down" in final.error
        assert len(running.token_ids) < 200
        later = Outputs()
        process.submit("later", [1, 2, 3], SamplingParams(max_tokens=4), later)
        refused = later.wait(timeout=10)
        assert refused.rejected == "shutting_down" and refused.finish_reason == FinishReason.ERROR
        assert process.process.poll() is None, "a drained engine waits for its handle's stop"
    finally:
        process.shutdown()
    assert process.process.returncode == 0

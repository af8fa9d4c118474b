"""Closed-loop load for the serving benchmark: streaming clients, the engine alone, and metrics.

A closed loop at concurrency C keeps C requests in flight: each slot sends its next request as
soon as its previous one has ended. Slots take the next request from one shared counter, so
every request is sent exactly once, in order, whichever slot is free first.

Clients run in worker processes (`spawn`), so the client side is not what limits the server:
- gRPC: tritonclient's `start_stream` / `async_stream_infer`, one client and stream per slot
  (a stream reports errors without the request id, so requests are not multiplexed);
- HTTP: `generate_stream` over aiohttp, one connection per slot.
Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: comparable across processes).

Per request: send time, first and last response times, responses, output tokens. A response
can carry several tokens (the server coalesces when the client side falls behind), so
inter-token latency is per request (last - first) / (tokens - 1), as genai-perf defines it.
Text endpoints report no token count; their output lengths are exact (min_tokens = max_tokens),
so the requested length is the count.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import multiprocessing as mp
import os
import queue
import random
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class LoadRequest:
    text: str  # for ensemble and tensorrt_llm_bls
    prompt_ids: list[int]  # what preprocessing makes of `text` (tensorrt_llm, engine alone)
    output_len: int


@dataclass
class Record:
    index: int
    sent: float
    first: float | None = None
    last: float | None = None
    responses: int = 0
    tokens: int = 0
    output: str | list[int] = ""  # text, or token ids for tensorrt_llm
    error: str | None = None
    engine: dict[str, float] | None = None  # the engine's perf-metric times, on `sent`'s clock
    gaps: list[float] | None = None  # seconds between consecutive events that carried output

    def event(self, now: float) -> None:
        """An event with output reached the client at `now`."""
        if self.last is not None:
            self.gaps = self.gaps or []
            self.gaps.append(now - self.last)
        self.first = self.first or now
        self.last = now
        self.responses += 1


@dataclass
class Target:
    """What one load run talks to."""

    kind: str  # "grpc", "http", "openai" or "engine"
    model: str = "ensemble"  # ensemble | tensorrt_llm_bls | tensorrt_llm; openai: the model name
    url: str = ""
    exact_with: str = "min_tokens"  # how output lengths are made exact: min_tokens | end_id
    timeline: bool = False  # gRPC: ask for the perf-metric outputs (where a request's time goes)


# ---- metrics ---------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values) * 1e3
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def summarize(records: list[Record], requests: list[LoadRequest]) -> dict:
    ok = [r for r in records if r.error is None and r.first is not None]
    failed = [r for r in records if r not in ok]
    for r in ok:
        r.tokens = r.tokens or requests[r.index].output_len
    start = min(r.sent for r in records)
    end = max((r.last for r in ok), default=start)
    wall = max(end - start, 1e-9)
    tokens = sum(r.tokens for r in ok)
    return {
        "num_requests": len(records),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(ok) / wall,
        "responses_per_request": float(np.mean([r.responses for r in ok])) if ok else 0.0,
        "ttft_ms": percentiles([r.first - r.sent for r in ok]),
        "itl_ms": percentiles([(r.last - r.first) / (r.tokens - 1) for r in ok if r.tokens > 1]),
        # What a streaming client sees: every gap between two events with output (a burst of
        # tokens in one event shows here, not in the average above).
        "event_gap_ms": percentiles([g for r in ok for g in r.gaps or ()]),
        "e2e_ms": percentiles([r.last - r.sent for r in ok]),
        **({"timeline_ms": timeline(ok)} if any(r.engine for r in ok) else {}),
    }


# The stages of a request, client and engine clocks made one: (name, from, to).
STAGES = (
    ("to_engine", "sent", "arrival"),
    ("queued", "arrival", "first_scheduled"),
    ("to_first_token", "first_scheduled", "first_token"),
    ("first_token_to_client", "first_token", "first"),
    ("last_token_to_client", "last_token", "last"),
)


def timeline(records: list[Record]) -> dict[str, dict[str, float]]:
    """Percentiles of each stage (STAGES) over the requests that carry the engine's times."""
    times = [
        {"sent": r.sent, "first": r.first, "last": r.last, **r.engine} for r in records if r.engine
    ]
    return {name: percentiles([t[end] - t[start] for t in times]) for name, start, end in STAGES}


# ---- engine alone ----------------------------------------------------------------------------
def engine_closed_loop(
    executor,
    requests: list[LoadRequest],
    concurrency: int,
    exact_with: str = "min_tokens",
    jitter_s: float = 0.0,
) -> list[Record]:
    """The same closed loop against an in-process Executor (no Triton, no IPC). `jitter_s`: a
    slot sends its next request a random time in [0, jitter_s] after its last one ended, as a
    server's round trip would; at 0 it sends at once, so requests that start together keep
    starting and ending together."""
    from backend.sampling_params import SamplingParams

    records = [Record(i, 0.0) for i in range(len(requests))]
    ended: queue.SimpleQueue = queue.SimpleQueue()
    tag = f"load-{time.monotonic_ns()}"

    def submit(i: int) -> None:
        req, rec = requests[i], records[i]
        exact = (
            {"min_tokens": req.output_len}
            if exact_with == "min_tokens"
            else {"ignore_end_id": True}
        )
        rec.sent = time.perf_counter()

        def on_output(out, rec=rec) -> None:
            now = time.perf_counter()
            if out.new_token_ids:
                rec.event(now)
                rec.tokens += len(out.new_token_ids)
                rec.output += out.new_token_ids
            if out.finished:
                rec.error = out.error
                ended.put(rec.index)

        rec.output = []
        executor.submit(
            f"{tag}-{i}",
            req.prompt_ids,
            SamplingParams(max_tokens=req.output_len, **exact),
            on_output,
        )

    sent = 0
    for _ in range(min(concurrency, len(requests))):
        submit(sent)
        sent += 1
    rng = random.Random(len(requests))
    due: list[tuple[float, int]] = []  # (when, index): the next request of a slot, delayed
    for _ in range(len(requests)):
        while True:
            try:
                ended.get(timeout=max(0.0, due[0][0] - time.perf_counter()) if due else None)
                break
            except queue.Empty:
                submit(heapq.heappop(due)[1])
        if sent < len(requests):
            heapq.heappush(due, (time.perf_counter() + rng.uniform(0, jitter_s), sent))
            sent += 1
        while due and due[0][0] <= time.perf_counter():
            submit(heapq.heappop(due)[1])
    return records


# ---- Triton clients --------------------------------------------------------------------------
STALL_S = 120.0  # no request finished and no client reported for this long: the load is stuck
WATCH_PERIOD_S = 1.0


def run_clients(
    target: Target,
    requests: list[LoadRequest],
    concurrency: int,
    processes: int,
    gone=None,
    stall_s: float = STALL_S,
    cpus: set[int] | None = None,
) -> list[Record]:
    """Closed loop at `concurrency` through `processes` client processes (on `cpus`, when
    given). `gone()`: why the server is gone (a message), else None; checked every second.
    Raises RuntimeError as soon as it is gone, or when no request has finished for `stall_s`,
    instead of waiting on clients whose server will never answer."""
    processes = max(1, min(processes, concurrency))
    ctx = mp.get_context("spawn")
    counter = ctx.Value("i", 0)
    results = ctx.Queue()
    start = ctx.Event()
    shares = [concurrency // processes + (p < concurrency % processes) for p in range(processes)]
    workers = [
        ctx.Process(
            target=_worker,
            args=(target, requests, share, counter, start, results, cpus),
            daemon=True,
        )
        for share in shares
    ]
    for w in workers:
        w.start()
    watch = _Watch(results, counter, workers, gone, stall_s)
    ready = [watch.next() for _ in workers]  # each worker says it is ready
    assert all(r == "ready" for r in ready), ready
    start.set()
    records: list[Record] = []
    for _ in workers:
        part = watch.next()
        if isinstance(part, str):
            raise RuntimeError(f"a client process failed: {part}")
        records += [Record(**r) for r in part]
    for w in workers:
        w.join(timeout=30)
    records.sort(key=lambda r: r.index)
    return records


class _Watch:
    """The client processes' next report, watching the server and the load's progress (the
    shared counter moves each time a slot's request ends) while it waits."""

    def __init__(self, results, counter, workers, gone, stall_s: float):
        self.results, self.counter, self.workers = results, counter, workers
        self.gone, self.stall_s = gone, stall_s
        self.taken, self.moved = -1, time.monotonic()

    def next(self):
        while True:
            try:
                report = self.results.get(timeout=WATCH_PERIOD_S)
                self.moved = time.monotonic()
                return report
            except queue.Empty:
                pass
            why = self.gone() if self.gone is not None else None
            if why is None and self.counter.value != self.taken:
                self.taken, self.moved = self.counter.value, time.monotonic()
            elif why is None and time.monotonic() - self.moved > self.stall_s:
                why = f"no request finished for {self.stall_s:.0f} s"
            if why is not None:
                for w in self.workers:
                    w.kill()
                raise RuntimeError(f"the load stopped: {why}")


def _worker(target: Target, requests, slots: int, counter, start, results, cpus) -> None:
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        take = _Taker(counter, len(requests))
        run = _grpc_slots if target.kind == "grpc" else _http_slots
        results.put("ready")
        start.wait()
        records = run(target, requests, slots, take)
        results.put([asdict(r) for r in records])
    except BaseException as exc:  # reported to the parent, which raises
        results.put(f"{type(exc).__name__}: {exc}")


class _Taker:
    """The next request index from the counter shared by all client processes."""

    def __init__(self, counter, total: int):
        self.counter, self.total = counter, total

    def __call__(self) -> int | None:
        with self.counter.get_lock():
            i = self.counter.value
            if i >= self.total:
                return None
            self.counter.value = i + 1
            return i


# gRPC ---------------------------------------------------------------------------------------
def grpc_inputs(
    model: str, req: LoadRequest, exact_with: str, stream: bool = True, perf_metrics: bool = False
):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    arrays = request_arrays(model, req, exact_with, stream, perf_metrics)
    inputs = []
    for name, value in arrays.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


# The engine's times of a request (perf-metric outputs, ns since the epoch) -> Record.engine keys.
ENGINE_TIMES = {
    "arrival_time_ns": "arrival",
    "first_scheduled_time_ns": "first_scheduled",
    "first_token_time_ns": "first_token",
    "last_token_time_ns": "last_token",
}
# time.time() - time.perf_counter(): the engine's wall-clock times on the clients' clock.
_CLOCK_OFFSET = time.time() - time.perf_counter()


def engine_times(result) -> dict[str, float]:
    return {
        key: int(result.as_numpy(name).reshape(-1)[0]) / 1e9 - _CLOCK_OFFSET
        for name, key in ENGINE_TIMES.items()
    }


def request_arrays(
    model: str, req: LoadRequest, exact_with: str, stream: bool, perf_metrics: bool = False
) -> dict:
    """Input tensors of one request, as a TensorRT-LLM backend client sends them."""
    exact = (
        ("min_tokens", np.array([[req.output_len]], np.int32))
        if exact_with == "min_tokens"
        else ("end_id", np.array([[-1]], np.int32))
    )
    timed = {"return_perf_metrics": np.array([[True]], bool)} if perf_metrics else {}
    if model == "tensorrt_llm":
        return {
            "input_ids": np.array([req.prompt_ids], np.int32),
            "input_lengths": np.array([[len(req.prompt_ids)]], np.int32),
            "request_output_len": np.array([[req.output_len]], np.int32),
            "streaming": np.array([[stream]], bool),
            exact[0]: exact[1],
            **timed,
        }
    return {
        "text_input": np.array([[req.text.encode()]], dtype=object),
        "max_tokens": np.array([[req.output_len]], np.int32),
        "stream": np.array([[stream]], bool),
        exact[0]: exact[1],
        **timed,
    }


def _grpc_slots(target: Target, requests, slots: int, take) -> list[Record]:
    import tritonclient.grpc as grpcclient

    records: list[Record] = []
    lock = threading.Lock()
    idle = threading.Semaphore(0)
    output_name = "output_ids" if target.model == "tensorrt_llm" else "text_output"

    class Slot:
        def __init__(self):
            self.client = grpcclient.InferenceServerClient(target.url)
            self.record: Record | None = None
            self.client.start_stream(callback=self.on_response)

        def send_next(self) -> None:
            i = take()
            if i is None:
                self.record = None
                idle.release()
                return
            self.record = Record(
                i, time.perf_counter(), output=[] if output_name == "output_ids" else ""
            )
            with lock:
                records.append(self.record)
            self.client.async_stream_infer(
                target.model,
                grpc_inputs(target.model, requests[i], target.exact_with, True, target.timeline),
                request_id=str(i),
                enable_empty_final_response=True,
            )

        def on_response(self, result, error) -> None:
            rec, now = self.record, time.perf_counter()
            if error is not None:
                rec.error = str(error)
                self.send_next()
                return
            response = result.get_response()
            value = result.as_numpy(output_name) if response.outputs else None
            if value is not None and value.size:
                rec.event(now)
                if output_name == "output_ids":
                    ids = value.reshape(-1).tolist()
                    rec.output += ids
                    rec.tokens += len(ids)
                else:
                    rec.output += value.reshape(-1)[0].decode("utf-8")
            if target.timeline and result.as_numpy("last_token_time_ns") is not None:
                rec.engine = engine_times(result)
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                self.send_next()

    pool = [Slot() for _ in range(slots)]
    for slot in pool:
        slot.send_next()
    for _ in pool:
        idle.acquire()
    for slot in pool:
        slot.client.stop_stream()
        slot.client.close()
    return records


# HTTP ---------------------------------------------------------------------------------------
def http_body(model: str, req: LoadRequest, exact_with: str, stream: bool) -> dict:
    """The JSON body of Triton's generate endpoints (one value per input, no batch dimension)."""
    return {
        name: _json_value(value)
        for name, value in request_arrays(model, req, exact_with, stream).items()
    }


def _json_value(value: np.ndarray):
    flat = (
        value.reshape(-1).tolist()
        if value.dtype != object
        else [v.decode() for v in value.reshape(-1)]
    )
    return flat[0] if len(flat) == 1 else flat


def _http_slots(target: Target, requests, slots: int, take) -> list[Record]:
    return asyncio.run(_http_main(target, requests, slots, take))


def _stream_protocol(target: Target):
    """(url, body of request i, event -> (text, error)) of a streaming HTTP target: Triton's
    generate_stream, or the OpenAI front end's /v1/completions (`target.model` is then the
    served model's name)."""
    if target.kind == "openai":

        def body(req: LoadRequest) -> dict:
            exact = (
                {"min_tokens": req.output_len}
                if target.exact_with == "min_tokens"
                else {"ignore_eos": True}
            )
            return {
                "model": target.model,
                "prompt": req.text,
                "max_tokens": req.output_len,
                "temperature": 0,
                "stream": True,
                **exact,
            }

        def parse(event: dict) -> tuple[str, str | None]:
            if "error" in event:
                return "", str(event["error"].get("message", event["error"]))
            return "".join(c.get("text", "") for c in event.get("choices", ())), None

        return f"http://{target.url}/v1/completions", body, parse

    def triton_body(req: LoadRequest) -> dict:
        return http_body(target.model, req, target.exact_with, stream=True)

    def triton_parse(event: dict) -> tuple[str, str | None]:
        return event.get("text_output", ""), event.get("error")

    url = f"http://{target.url}/v2/models/{target.model}/generate_stream"
    return url, triton_body, triton_parse


async def _http_main(target: Target, requests, slots: int, take) -> list[Record]:
    import aiohttp

    records: list[Record] = []
    url, body_of, parse = _stream_protocol(target)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=slots)

    async def slot(session) -> None:
        while (i := take()) is not None:
            rec = Record(i, time.perf_counter())
            records.append(rec)
            try:
                async with session.post(url, json=body_of(requests[i])) as response:
                    async for line in response.content:
                        if not line.startswith(b"data:"):
                            continue
                        now = time.perf_counter()
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            break
                        text, error = parse(json.loads(payload))
                        if error is not None:
                            rec.error = error
                            break
                        if text:  # an event the client sees output in
                            rec.event(now)
                            rec.output += text
                    if response.status != 200 and rec.error is None:
                        rec.error = f"HTTP {response.status}"
            except aiohttp.ClientError as exc:
                rec.error = f"{type(exc).__name__}: {exc}"

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(slot(session) for _ in range(slots)))
    return records


# ---- one request, non-streamed and streamed (exactness check) --------------------------------
def generate_once(
    http_url: str, model: str, req: LoadRequest, exact_with: str, stream: bool
) -> str:
    """The text of one request through HTTP generate (stream=False) or generate_stream."""
    import urllib.request

    endpoint = "generate_stream" if stream else "generate"
    data = json.dumps(http_body(model, req, exact_with, stream)).encode()
    request = urllib.request.Request(f"http://{http_url}/v2/models/{model}/{endpoint}", data=data)
    text = []
    with urllib.request.urlopen(request, timeout=600) as response:
        body = response.read().decode()
    for line in body.splitlines() if stream else [body]:
        line = line[5:] if line.startswith("data:") else line
        if line.strip():
            event = json.loads(line)
            if "error" in event:
                raise RuntimeError(event["error"])
            text.append(event.get("text_output", ""))
    return "".join(text)

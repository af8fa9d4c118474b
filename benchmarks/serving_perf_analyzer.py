"""The serving benchmark's load from perf_analyzer (Triton's C++ load generator) instead of
Python clients: the same requests, closed loop at concurrency C over a gRPC stream.

perf_analyzer sends the requests of its input-data file in turn. Its own count of completed
requests per second is the throughput (times the exact output length: min_tokens = max_tokens);
its profile export (`--profile-export-file`: when each request was sent, when each response
came) gives the time to the first response. Inter-token and end-to-end latency are not taken
from it: a request still running when a measurement window closes is exported with the responses
it had by then. It measures until it has seen `--measurement-request-count` requests in each of
its trials (three here; stability not asked).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serving_load import LoadRequest, Record, request_arrays, summarize

TRIALS = 3
THROUGHPUT = re.compile(r"Throughput: ([\d.]+) infer/sec")


@dataclass
class PerfAnalyzerRun:
    requests_per_s: float  # perf_analyzer's own figure, over its measurement windows
    records: list[Record]  # one per exported request: sent and response times


def input_data(model: str, requests: list[LoadRequest], exact_with: str) -> dict:
    """perf_analyzer's --input-data: one entry per request, each input as a flat list."""
    entries = []
    for req in requests:
        arrays = request_arrays(model, req, exact_with, stream=True)
        entries.append({name: _flat(value.reshape(-1).tolist()) for name, value in arrays.items()})
    return {"data": entries}


def run_perf_analyzer(
    url: str, model: str, requests: list[LoadRequest], concurrency: int, exact_with: str
) -> PerfAnalyzerRun:
    """Run perf_analyzer against `model` at `url` (gRPC). Raises RuntimeError with its output
    when it fails."""
    from ensemble import perf_analyzer as pa

    problem = pa.missing()
    if problem:
        raise RuntimeError(f"perf_analyzer cannot run: {problem}")
    entries = input_data(model, requests, exact_with)
    with tempfile.TemporaryDirectory(prefix="pa-") as tmp:
        data = Path(tmp) / "input_data.json"
        data.write_text(json.dumps(entries))
        options = {
            "-m": model,
            "-u": url,
            "-i": "grpc",
            "--input-data": str(data),
            "--concurrency-range": str(concurrency),
            "--measurement-mode": "count_windows",
            "--measurement-request-count": str(max(concurrency, len(requests) // TRIALS)),
            "--stability-percentage": "999",
            "--max-trials": str(TRIALS),
        }
        args = ["--async", "--streaming", *(x for pair in options.items() for x in pair)]
        for name, values in entries["data"][0].items():
            args += ["--shape", f"{name}:{len(values)}"]
        stdout, exported = _run_until_exported(pa, args, Path(tmp))
    found = THROUGHPUT.search(stdout)
    if found is None:
        raise RuntimeError("perf_analyzer printed no throughput:\n" + stdout[-3000:])
    index = {_key(e): i for i, e in enumerate(entries["data"])}
    records = []
    for experiment in exported["experiments"]:
        for req in experiment["requests"]:
            stamps = [t / 1e9 for t in req["response_timestamps"]]
            records.append(
                Record(
                    index=index[_key(req["request_inputs"])],
                    sent=req["timestamp"] / 1e9,
                    first=stamps[0] if stamps else None,
                    last=stamps[-1] if stamps else None,
                    responses=len(stamps),
                    error=None if stamps else "no response",
                )
            )
    return PerfAnalyzerRun(float(found.group(1)), records)


def perf_analyzer_summary(
    url: str, model: str, requests: list[LoadRequest], concurrency: int, exact_with: str
) -> dict:
    """The serving benchmark's summary of a perf_analyzer run: its throughput, the time to the
    first response; no inter-token or end-to-end latency (see the module docstring)."""
    run = run_perf_analyzer(url, model, requests, concurrency, exact_with)
    summary = summarize(run.records, requests)
    tokens_per_request = sum(r.output_len for r in requests) / len(requests)
    summary.update(
        requests_per_s=run.requests_per_s,
        output_tokens_per_s=run.requests_per_s * tokens_per_request,
        itl_ms={},
        e2e_ms={},
    )
    return summary


def _run_until_exported(pa, args: list[str], tmp: Path) -> tuple[str, dict]:
    """perf_analyzer's output and its profile export. It has exited 0 with an empty export, and
    once with a malformed one (H100, BLS at 256): then it runs again, into a new file (it refuses
    to write over one)."""
    for attempt in range(3):
        export = tmp / f"export_{attempt}.json"
        args_now = args + ["--profile-export-file", str(export)]
        result = pa.run(args_now, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            output = (result.stdout + result.stderr)[-3000:]
            raise RuntimeError(f"perf_analyzer failed ({result.returncode}):\n{output}")
        try:
            return result.stdout, json.loads(export.read_text())
        except (OSError, ValueError):
            continue
    raise RuntimeError(f"perf_analyzer left no readable profile export:\n{result.stdout}")


def _flat(values: list) -> list:
    return [v.decode() if isinstance(v, bytes) else v for v in values]


def _key(inputs: dict) -> str:
    """A request's prompt, by which an exported request finds its entry."""
    value = inputs.get("text_input", inputs.get("input_ids"))
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    return json.dumps(value)

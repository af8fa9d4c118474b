"""The serving benchmark's load from perf_analyzer (Triton's C++ load generator) instead of
Python clients: the same requests, closed loop at concurrency C over a gRPC stream.

perf_analyzer sends the requests of its input-data file in turn and writes, per request, when it
was sent and when each response came (`--profile-export-file`); those become the same records
the Python clients produce, so the same summary (tokens/s, TTFT, inter-token, end-to-end) comes
out. Output lengths are exact (min_tokens = max_tokens), so a request's tokens are its
output_len. It measures until it has seen `--measurement-request-count` requests in each of
its trials (three here; stability not asked); a flag-only final response is not counted.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks.serving_load import LoadRequest, Record, request_arrays

TRIALS = 3


def input_data(model: str, requests: list[LoadRequest], exact_with: str) -> dict:
    """perf_analyzer's --input-data: one entry per request, each input as a flat list."""
    entries = []
    for req in requests:
        arrays = request_arrays(model, req, exact_with, stream=True)
        entries.append({name: [v.decode() if isinstance(v, bytes) else v
                               for v in value.reshape(-1).tolist()]
                        for name, value in arrays.items()})
    return {"data": entries}


def perf_analyzer_records(url: str, model: str, requests: list[LoadRequest], concurrency: int,
                          exact_with: str, timeout_s: float = 600) -> list[Record]:
    """Run perf_analyzer against `model` at `url` (gRPC) and return one Record per request it
    measured. Raises RuntimeError with its output when it fails."""
    from ensemble import perf_analyzer as pa

    problem = pa.missing()
    if problem:
        raise RuntimeError(f"perf_analyzer cannot run: {problem}")
    entries = input_data(model, requests, exact_with)
    with tempfile.TemporaryDirectory(prefix="pa-") as tmp:
        data = Path(tmp) / "input_data.json"
        data.write_text(json.dumps(entries))
        shapes = [f"{name}:{len(values)}" for name, values in entries["data"][0].items()]
        args = ["-m", model, "-u", url, "-i", "grpc", "--async", "--streaming",
                "--input-data", str(data), "--concurrency-range", str(concurrency),
                "--measurement-mode", "count_windows",
                "--measurement-request-count", str(max(concurrency, len(requests) // TRIALS)),
                "--stability-percentage", "999", "--max-trials", str(TRIALS)]
        for shape in shapes:
            args += ["--shape", shape]
        # It has exited 0 with an empty export now and then: run again, into a new file (it
        # refuses to write over one).
        for attempt in range(3):
            export = Path(tmp) / f"export_{attempt}.json"
            result = pa.run(args + ["--profile-export-file", str(export)], capture_output=True,
                            text=True, timeout=timeout_s)
            if result.returncode != 0:
                raise RuntimeError(f"perf_analyzer failed ({result.returncode}):\n"
                                   + (result.stdout + result.stderr)[-3000:])
            if export.exists() and export.read_text().strip():
                break
        else:
            raise RuntimeError("perf_analyzer left an empty profile export three times:\n"
                               + result.stdout[-3000:])
        experiments = json.loads(export.read_text())["experiments"]
    index = {_key(e): i for i, e in enumerate(entries["data"])}
    records = []
    for experiment in experiments:
        for req in experiment["requests"]:
            stamps = [t / 1e9 for t in req["response_timestamps"]]
            records.append(Record(index=index[_key(req["request_inputs"])],
                                  sent=req["timestamp"] / 1e9,
                                  first=stamps[0] if stamps else None,
                                  last=stamps[-1] if stamps else None, responses=len(stamps),
                                  error=None if stamps else "no response"))
    return records


def _key(inputs: dict) -> str:
    """A request's prompt, by which an exported request finds its entry."""
    value = inputs.get("text_input", inputs.get("input_ids"))
    return json.dumps(value[0] if isinstance(value, list) and len(value) == 1
                      and isinstance(value[0], str) else value)

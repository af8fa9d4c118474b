"""perf_analyzer drives a short gRPC streaming load against `ensemble` with no failed request:
the README's command and request data, as printed (the one Triton's own CI uses for a
TensorRT-LLM ensemble: text_input, stream, max_tokens, bad_words, stop_words).
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest

from tests.e2e.clients import metrics

pytestmark = pytest.mark.e2e
README = Path(__file__).resolve().parents[2] / "README.md"


def _count(samples: dict, name: str, model: str) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and ("model", model) in labels)


@pytest.fixture(scope="module")
def perf_analyzer():
    from ensemble import perf_analyzer as pa

    if pa.missing():
        try:
            pa.setup()
        except Exception as exc:  # any setup failure is a reason to skip
            pytest.skip(f"perf_analyzer cannot be set up here: {exc}")
    return pa


def readme_command() -> tuple[str, list[str]]:
    """The README's perf_analyzer example: the request data its heredoc writes, and the
    arguments after `run --`."""
    text = README.read_text()
    block = text[text.index("Load with perf_analyzer") :]
    block = block[
        block.index("```bash") + len("```bash") : block.index("```", block.index("```bash") + 7)
    ]
    data = block[block.index("<<'JSON'") + len("<<'JSON'") : block.index("\nJSON\n")].strip()
    command = block[block.index("ensemble.perf_analyzer run --") :].replace("\\\n", " ")
    return data, shlex.split(command)[3:]


def test_streaming_load_without_failures(triton, perf_analyzer, tmp_path):
    data_text, printed = readme_command()
    data = tmp_path / "input_data.json"
    data.write_text(data_text)
    args = [
        triton.grpc if a == "localhost:8001" else str(data) if a == "/tmp/input_data.json" else a
        for a in printed
    ]
    assert "localhost:8001" in printed and "/tmp/input_data.json" in printed
    before = metrics(triton.metrics)
    # Under a whole test run's load perf_analyzer has exited 0 with its throughput line and an
    # empty export file: then it runs again, into a new file (it refuses an existing one); the
    # server's counters below cover every run.
    for attempt in range(3):
        export = tmp_path / f"profile_export_{attempt}.json"
        result = perf_analyzer.run(
            [*args, "--profile-export-file", str(export)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Throughput" in result.stdout
        if export.exists() and export.read_text().strip():
            break
    else:
        pytest.fail(
            "perf_analyzer left an empty profile export three times:\n" + result.stdout[-3000:]
        )

    requests = [r for e in json.loads(export.read_text())["experiments"] for r in e["requests"]]
    assert len(requests) >= 8, result.stdout[-3000:]
    assert all(len(r["response_timestamps"]) >= 2 for r in requests)  # streamed pieces
    # The server counts a request when it has finished with it, which may come a moment after
    # the client read its last response: wait up to 10 s for the counters to catch up.
    deadline = time.monotonic() + 10
    while True:
        after = metrics(triton.metrics)
        succeeded = _count(after, "nv_inference_request_success", "ensemble") - _count(
            before, "nv_inference_request_success", "ensemble"
        )
        failed = _count(after, "nv_inference_request_failure", "ensemble") - _count(
            before, "nv_inference_request_failure", "ensemble"
        )
        if succeeded >= len(requests) or failed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert failed == 0, f"{failed} failed requests\n" + result.stdout[-3000:]
    assert succeeded >= len(requests), f"{succeeded} successes for {len(requests)} requests"


def test_serving_benchmark_reads_perf_analyzer(triton, perf_analyzer, tokenizer):
    """benchmarks.serving's perf_analyzer target: its throughput line is read, each exported
    request is matched to its prompt and has streamed at most its (exact) output length."""
    from benchmarks.serving_load import LoadRequest
    from benchmarks.serving_perf_analyzer import perf_analyzer_summary, run_perf_analyzer
    from preprocessing.tokenizer import encode

    texts = ["Hello, my name is", "The capital of France is", "Le café à côté de l'église est"]
    requests = [LoadRequest(t, encode(tokenizer, t), 3 + i) for i, t in enumerate(texts)]
    run = run_perf_analyzer(triton.grpc, "ensemble", requests, 2, "min_tokens")
    assert run.requests_per_s > 0
    assert len(run.records) >= 3 and {r.index for r in run.records} == {0, 1, 2}
    assert all(
        r.error is None and 1 <= r.responses <= requests[r.index].output_len for r in run.records
    )
    summary = perf_analyzer_summary(triton.grpc, "ensemble", requests, 2, "min_tokens")
    assert summary["failed"] == 0 and summary["ttft_ms"]["p50"] > 0
    assert summary["output_tokens_per_s"] == summary["requests_per_s"] * 4  # mean length 4

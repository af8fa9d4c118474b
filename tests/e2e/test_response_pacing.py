"""Responses under load with two instances of tensorrt_llm and a response rate limit, on the null
model (its steps cost nothing, so the engine outruns the response path): each stream's pieces,
concatenated, are exactly its tokens, and the responses between a stream's first and last stay
within the limit (per second, over all streams)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.clients import grpc_request
from tests.e2e.conftest import running_triton

pytestmark = pytest.mark.e2e

STREAMS, TOKENS = 16, 64


@pytest.fixture(scope="module")
def null_dir():
    from backend.loading.disk_cache import cache_root
    from backend.loading.model_paths import resolve_model
    from backend.loading.presets import write_preset

    return write_preset("null", cache_root(), tokenizer_from=resolve_model("default"))


def stream_all(grpc_url: str):
    from backend.models.null import null_token

    prompts = [[1000 + 37 * i + j for j in range(20 + i)] for i in range(STREAMS)]

    def ask(ids):
        return grpc_request(
            grpc_url,
            "tensorrt_llm",
            {
                "input_ids": ids,
                "input_lengths": len(ids),
                "request_output_len": TOKENS,
                "end_id": -1,
                "streaming": True,
            },
        )

    start = time.monotonic()
    with ThreadPoolExecutor(STREAMS) as pool:
        streams = list(pool.map(ask, prompts))
    wall_s = time.monotonic() - start
    for ids, stream in zip(prompts, streams):
        assert stream.error is None, stream.error
        expected = [null_token(p) for p in range(len(ids), len(ids) + TOKENS)]
        assert stream.ids() == expected
    return [len(s.responses) for s in streams], wall_s


@pytest.mark.parametrize("limit", [20, 0])
def test_paced_streams_stay_within_the_limit_and_exact(tmp_path, null_dir, limit):
    with running_triton(
        tmp_path,
        model_path=null_dir,
        llm_instance_count=2,
        response_rate_limit=limit,
        max_batch_size=STREAMS,
    ) as triton:
        counts, wall_s = stream_all(triton.grpc)
    # First and last responses never wait; each row's others wait their turn, so at most `limit`
    # a second leave the server (plus one a row that came due as the others ended).
    if limit:
        paced = sum(counts) - 2 * STREAMS
        assert paced <= limit * wall_s + STREAMS, (counts, wall_s)

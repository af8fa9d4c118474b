"""One real tritonserver for the end-to-end tests, serving the checked-in model repository's models.

The repository is built by `ensemble` with small engine settings for a CPU (small KV cache, short
max_seq_len) into a temporary directory, on free ports; the server is stopped at the end.
$E2E_TENSOR_PARALLEL_SIZE (e.g. 3 for the default model's 9 heads) runs every server's engine
split across that many ranks.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from ensemble.build import build_repository
from ensemble.server import TritonServer, free_port
from ensemble.settings import ServeSettings

E2E_SETTINGS = dict(
    device="cpu",
    max_batch_size=16,
    max_num_tokens=1024,
    max_seq_len=512,
    tokens_per_block=16,
    max_tokens_in_paged_kv_cache=8192,
    triton_max_batch_size=8,
    default_max_tokens=32,
    cancellation_check_period_ms=50,
    stats_check_period_ms=100,
    tensor_parallel_size=int(os.environ.get("E2E_TENSOR_PARALLEL_SIZE", "1")),
)


@dataclass
class Triton:
    settings: ServeSettings
    server: TritonServer
    log_file: Path

    @property
    def http(self) -> str:
        return self.server.http_url

    @property
    def grpc(self) -> str:
        return self.server.grpc_url

    @property
    def metrics(self) -> str:
        return self.server.metrics_url


@pytest.fixture(scope="package")
def triton(tmp_path_factory) -> Triton:
    # The defaults users run (one tensorrt_llm instance, unpaced): several instances crashed
    # tritonserver 2.51 under load; test_response_pacing and test_shared_engine cover them.
    # Package-scoped: one server for the end-to-end tests, which run together (tests/conftest.py
    # runs them first, all on one xdist worker), stopped after the last of them (~5-8 s) while
    # the other worker is still busy, not at the end of the session.
    with running_triton(tmp_path_factory.mktemp("triton")) as server:
        yield server


@contextmanager
def running_triton(tmp: Path, **settings_overrides) -> Iterator[Triton]:
    """A tritonserver on free ports with E2E_SETTINGS (and the overrides), stopped on exit."""
    pytest.importorskip("pytriton", reason="nvidia-pytriton (the tritonserver binary) is missing")
    from backend.loading.model_paths import resolve_model

    resolve_model("default")  # convert once here, not in three stubs at once
    settings = ServeSettings(
        **{**E2E_SETTINGS, **settings_overrides},
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    repository = build_repository(settings, tmp / "model_repository")
    log_file = tmp / "tritonserver.log"
    server = TritonServer(
        repository, settings.http_port, settings.grpc_port, settings.metrics_port, log_file=log_file
    )
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        yield Triton(settings, server, log_file)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tokenizer():
    from backend.loading.model_paths import resolve_model
    from preprocessing.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("default"))

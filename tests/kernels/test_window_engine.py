"""A tiny Mistral with a sliding window served with the Triton attention kernels (interpreted
on CPU) gives the torch reference's tokens: the layers pass their window to the kernels, and the
blocks released outside the window are never read."""

from __future__ import annotations

import pytest

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.config import EngineConfig  # noqa: E402
from backend.engine.executor import Executor  # noqa: E402
from backend.sampling_params import SamplingParams  # noqa: E402
from tests.tiny_models import random_prompts, save_tiny_hf_model  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]


def generate(path, prompts, backend: str, windows: list | None = None) -> list[list[int]]:
    config = EngineConfig(
        model_path=str(path),
        device=DEVICE,
        dtype="float32",
        attention_backend=backend,
        tokens_per_block=8,
        max_num_tokens=32,
        sink_token_length=4,
        cuda_graphs=False,
    )
    executor = Executor(config)
    try:
        assert executor.runner.attention.name == backend
        groups = [group.window for group in executor.scheduler.kv.groups]
        assert groups == (windows or [16])  # blocks outside a window are released
        params = SamplingParams(max_tokens=8, ignore_end_id=True)
        return [r["token_ids"] for r in executor.generate(prompts, params, timeout=600)]
    finally:
        executor.shutdown()


def test_triton_kernels_serve_a_windowed_mistral_like_the_reference(tmp_path):
    save_tiny_hf_model(tmp_path, "mistral", sliding_window=20)
    prompts = random_prompts(3, 640, seed=2, low=50, high=70)
    assert generate(tmp_path, prompts, "triton") == generate(tmp_path, prompts, "torch")


def test_triton_kernels_serve_local_and_global_kv_cache_groups_like_the_reference(tmp_path):
    """Gemma 3, five local layers (window 20, with 4 sinks) and one global: each layer passes
    its own group's block tables and slots to the kernels."""
    save_tiny_hf_model(tmp_path, "gemma3_text", sliding_window=20)
    prompts = random_prompts(2, 640, seed=3, low=50, high=70)
    windows = [None, 16]
    assert generate(tmp_path, prompts, "triton", windows) == generate(
        tmp_path, prompts, "torch", windows
    )

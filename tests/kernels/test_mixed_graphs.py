"""The mixed-step CUDA graphs' inputs: padded token and request counts, the staged copy, the
in-flight input fill, several KV cache groups.

Capturing needs a GPU (tests/gpu runs them). A replay before `capture` runs the graph's work
eagerly on the same buffers, so the padding is tested here on CPU with the kernels under the
Triton interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.config import EngineConfig  # noqa: E402
from backend.request import Chunk  # noqa: E402
from backend.runner.mixed_graphs import MixedGraphs, token_sizes  # noqa: E402
from backend.runner.model_runner import ModelRunner  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpretable_triton_language")


class StagedMixedGraphsRunner(ModelRunner):
    """Mixed-step graphs on CPU, not captured: steps are staged into the graphs' buffer and
    their work runs eagerly, padded as a replay is."""

    def _capture_mixed_graphs(self) -> MixedGraphs:
        return self.new_mixed_graphs()


def tiny_config(model_dir, **options) -> EngineConfig:
    """A CPU engine of the tiny model with the graphs' attention (the torch reference reads the
    host lengths a graph was built with, not the step's)."""
    base = dict(device=DEVICE, dtype="float32", tokens_per_block=4, attention_backend="triton")
    return EngineConfig(model_path=str(model_dir), **{**base, **options})


def test_token_sizes_pad_by_powers_of_two_then_by_256():
    assert token_sizes(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_sizes(100) == [16, 32, 64, 112]
    assert token_sizes(600) == [16, 32, 64, 128, 256, 512, 608]


def test_a_padded_step_gives_the_eager_steps_logits(tmp_path):
    """Two prompts staged and run padded (123 -> 128 tokens, 2 of 8 requests; the long one spans
    several of the attention kernel's query tiles, which the padded requests must not take), then
    a decode beside a new prompt in the other host slot: the sampled rows' logits and every
    cached key and value are the eager path's, and the padded tokens wrote no cache slot."""
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model(tmp_path, "llama")
    config = tiny_config(tmp_path, max_batch_size=8, max_num_tokens=128)
    eager, staged = ModelRunner(config), StagedMixedGraphsRunner(config)
    assert eager.mixed_graphs is None and staged.mixed_graphs is not None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (13, 110, 6)]
    first = [
        Chunk.of_sequence(prompts[0], [0, 1, 2, 3]),
        Chunk.of_sequence(prompts[1], list(range(4, 32))),
    ]
    second = [
        Chunk.of_sequence(prompts[0] + [7], [0, 1, 2, 3], start=13),
        Chunk.of_sequence(prompts[2], [32, 33]),
    ]
    steps = [first, second]
    for chunks in steps:
        want = eager.execute(chunks).logits
        inputs = staged.prepare(chunks)
        assert inputs.graph_tokens == (128 if chunks is first else 16)
        got = staged.execute(chunks).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert staged.mixed_graphs._staged == 4  # prepare + execute, twice
    torch.testing.assert_close(staged.kv_cache[:, :, :34], eager.kv_cache[:, :, :34])
    assert not staged.kv_cache[:, :, 34:].any()  # no padded token wrote past the used blocks


def test_prompt_logprobs_and_long_steps_run_eagerly(tmp_path):
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model(tmp_path, "llama")
    config = tiny_config(tmp_path, max_batch_size=2, max_num_tokens=64, cuda_graph_max_tokens=16)
    runner = StagedMixedGraphsRunner(config)
    assert runner.mixed_graphs.sizes == [16]
    short, long = (
        Chunk.of_sequence(list(range(3, 15)), [0, 1, 2]),
        Chunk.of_sequence(list(range(3, 23)), [3, 4, 5, 6, 7]),
    )
    assert runner.prepare([short]).graph_tokens == 16
    assert runner.prepare([long]).graph_tokens == 0  # 20 tokens: past the largest graph
    assert runner.prepare([short, short]).graph_tokens == 0  # 24 tokens
    assert runner.prepare([short], allow_graph=False).graph_tokens == 0


@pytest.mark.parametrize(
    "kind, options",
    [("qwen2", {}), ("gemma3_text", {"sliding_window": 8})],  # one KV cache group; two
)
def test_engine_steps_in_mixed_graphs_match_transformers(kind, options, tmp_path):
    """An engine with overlap scheduling (in-flight inputs filled into the buffer), chunked
    prompts beside decodes, every step of up to 32 tokens staged into the graphs: transformers'
    greedy tokens, and every block back in the pool. Gemma 3's local and global layers read
    their own group's slots and block tables."""
    from backend.engine.executor import Executor
    from backend.sampling_params import SamplingParams
    from tests.hf_reference import hf_greedy
    from tests.tiny_models import random_prompts, save_tiny_hf_model

    hf = save_tiny_hf_model(tmp_path, kind, **options)
    prompts = random_prompts(3, 640, seed=3, low=10, high=40)
    config = tiny_config(
        tmp_path,
        max_batch_size=3,
        max_num_tokens=24,
        cuda_graph_max_tokens=32,
        overlap_scheduling=True,
    )
    runner = StagedMixedGraphsRunner(config)
    executor = Executor(config, runner=runner)
    try:
        results = executor.generate(prompts, SamplingParams(max_tokens=10, ignore_end_id=True))
        assert executor.stats().kv.free_blocks == executor.stats().kv.max_blocks
    finally:
        executor.shutdown()
    assert [r["token_ids"] for r in results] == [hf_greedy(hf, p, 10)[0] for p in prompts]
    assert runner.mixed_graphs._staged >= 10  # the prompt chunks' steps and the decode steps

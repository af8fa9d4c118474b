"""The rule of programmatic dependent launch (`backend.kernels.pdl`): no kernel that reads step
inputs before its wait may start before the step inputs are written. The checker against the
chain that raced before b9758bf, and against the launches of a real one-token decode step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.kernels import embedding, step_inputs  # noqa: E402
from backend.kernels.pdl import (
    Ordering,
    StepInputRace,
    check_step_input_reads,  # noqa: E402
    recorded_launches,
)

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
EARLY_WRITER = Ordering("load_step_inputs", releases="before_wait", writes_step_inputs=True)
EARLY_EMBEDDING = Ordering("embedding", releases="before_wait")
QKV = Ordering("qkv_rope_gemv", releases="before_wait", reads_step_inputs_before_wait=True)
GEMV = Ordering("gemv", releases="before_wait")


def test_the_chain_that_raced_before_b9758bf_is_refused():
    """The input copy and the embedding both let their dependents launch before their own wait:
    layer 0's qkv could read positions and slots before the copy had written them."""
    with pytest.raises(
        StepInputRace, match="launch 2 \\(qkv_rope_gemv\\).*launch 0 \\(load_step_inputs\\)"
    ):
        check_step_input_reads([EARLY_WRITER, EARLY_EMBEDDING, QKV, GEMV])


def test_one_kernel_that_waits_before_it_releases_is_enough():
    check_step_input_reads(
        [EARLY_WRITER, embedding.ORDERING, QKV, GEMV, QKV]
    )  # b9758bf's embedding
    check_step_input_reads(
        [step_inputs.ORDERING, EARLY_EMBEDDING, QKV, GEMV]
    )  # b9758bf's input copy
    check_step_input_reads([QKV, GEMV, QKV])  # eager: host copies
    with pytest.raises(StepInputRace):  # releases before its wait all the way back to the writer
        check_step_input_reads([EARLY_WRITER, GEMV, GEMV, GEMV, QKV])


def test_a_one_token_decode_step_as_the_decode_graph_runs_it_keeps_the_rule(monkeypatch):
    """The launches of one decode graph step (input copy, the one-token layers, argmax), run
    eagerly on CPU: recorded, they pass the check; with the pre-b9758bf input copy and embedding
    they would not."""
    from backend.attention import get_attention_backend
    from backend.loading.model_loader import build_model
    from backend.loading.presets import init_random_weights
    from backend.model_config import ModelConfig
    from backend.models.llama import LlamaModel
    from backend.runner.decode_graphs import DecodeGraphs

    config = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 300,
            "hidden_size": 128,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    )
    model = build_model(
        config, torch.device(DEVICE), torch.float16, get_attention_backend("triton", DEVICE), 64
    )
    init_random_weights(model, seed=1)
    kv_cache = torch.zeros(2, 2, 4, 16, 2, 32, dtype=torch.float16, device=DEVICE)
    graphs = DecodeGraphs(model, kv_cache, max_batch_size=1, max_seq_len=64, tokens_per_block=16)
    graphs.stage(np.array([5]), np.array([6]), np.array([22]), np.array([7]), np.array([[1]]))
    monkeypatch.setattr(
        LlamaModel, "takes_one_token_path", lambda self, hidden: True
    )  # GPU-only choice
    with recorded_launches() as launches, torch.inference_mode():
        graphs.replay(1)
    names = [launch.kernel for launch in launches]
    assert names[0] == "load_step_inputs" and names[-2:] == ["argmax_chunks", "argmax_rows"]
    layers = ["qkv_rope_gemv", "decode_attention", "gemv", "gemv", "gemv"] * 2
    if torch.device(DEVICE).type == "cuda":  # embedding and lm_head are kernels there, torch here
        layers = ["embedding"] + layers + ["gemv"]
    assert names[1:-2] == layers
    check_step_input_reads(launches)
    after_embedding = launches[2:] if names[1] == "embedding" else launches[1:]
    with pytest.raises(StepInputRace):
        check_step_input_reads([EARLY_WRITER, EARLY_EMBEDDING] + after_embedding)

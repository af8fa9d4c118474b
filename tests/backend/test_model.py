"""Our Llama-family model and runner against transformers, on tiny random-weight checkpoints:
full prompts, chunked prefill through a shuffled paged cache, decode steps, packed batches."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backend.config import EngineConfig
from backend.layers.rotary import inverse_frequencies
from backend.model_config import ModelConfig, RopeConfig
from backend.request import Chunk, Request
from backend.runner.model_runner import ModelRunner
from backend.sampling_params import SamplingParams
from tests.tiny_models import FAMILY_KINDS, LLAMA3_ROPE

TPB = 4  # tokens per block: small, so prompts span many blocks

KINDS = {
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3-rope": ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "linear-rope": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "mistral": ("mistral", dict(sliding_window=None, head_dim=24)),
    "qwen2-qkv-bias": ("qwen2", dict(tie_word_embeddings=False)),
    **{kind: (kind, {}) for kind in FAMILY_KINDS},  # tests/tiny_models.family_config
}


def make_runner(model_dir, **config) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model_path=str(model_dir),
            device="cpu",
            tokens_per_block=TPB,
            max_batch_size=4,
            **config,
        )
    )


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def shuffled_blocks(runner: ModelRunner, num_tokens: int, seed: int) -> list[int]:
    blocks = list(range(runner.num_kv_blocks))
    random.Random(seed).shuffle(blocks)
    return blocks[: -(-num_tokens // TPB)]


@pytest.fixture(params=list(KINDS))
def model_pair(request, tiny_hf_model):
    model_type, overrides = KINDS[request.param]
    hf, path = tiny_hf_model(model_type, **overrides)
    return hf, make_runner(path)


def test_full_prompt_logits_match_transformers(model_pair):
    hf, runner = model_pair
    rng = random.Random(1)
    ids = [rng.randrange(runner.vocab_size) for _ in range(37)]
    inputs = runner.prepare([Chunk.of_sequence(ids, shuffled_blocks(runner, len(ids), 0))])
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.attn_meta)
        logits = runner.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_then_decode_matches_transformers(model_pair):
    hf, runner = model_pair
    rng = random.Random(2)
    ids = [rng.randrange(runner.vocab_size) for _ in range(30)]
    expected = hf_logits(hf, ids)
    blocks = shuffled_blocks(runner, len(ids), seed=3)
    # prompt of 25 tokens in chunks of 9, 11, 5 (crossing block boundaries), then 5 decodes
    bounds = [(0, 9), (9, 20), (20, 25)] + [(p, p + 1) for p in range(25, 30)]
    for start, end in bounds:
        logits = runner.execute([Chunk.of_sequence(ids[:end], blocks, start)]).logits
        assert logits.shape == (1, runner.vocab_size)
        torch.testing.assert_close(logits[0], expected[end - 1], atol=1e-4, rtol=1e-4)


def test_logits_written_into_a_given_buffer_equal_fresh_ones(model_pair):
    """compute_logits(hidden, out=buffer) (what the decode CUDA graphs do, all sizes sharing one
    buffer) writes the same logits into the buffer's rows, soft-capped ones included."""
    _, runner = model_pair
    hidden = torch.randn(
        3, runner.model_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        fresh = runner.model.compute_logits(hidden)
        buffer = torch.full((5, fresh.shape[1]), float("nan"))
        written = runner.model.compute_logits(hidden, out=buffer[:3])
    assert written.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:3], fresh)
    assert buffer[3:].isnan().all()


def test_packed_batch_equals_sequences_alone(tiny_hf_model):
    hf, path = tiny_hf_model("qwen2")
    runner = make_runner(path)
    rng = random.Random(4)
    a = [rng.randrange(runner.vocab_size) for _ in range(23)]
    b = [rng.randrange(runner.vocab_size) for _ in range(9)]
    blocks = shuffled_blocks(runner, 30 * TPB, seed=5)
    blocks_a, blocks_b = blocks[:6], blocks[6:9]
    # step 1: a's first chunk (no logits) and all of b; step 2: rest of a and b's decode
    step1 = runner.execute(
        [Chunk.of_sequence(a[:16], blocks_a, samples=False), Chunk.of_sequence(b[:8], blocks_b)]
    ).logits
    step2 = runner.execute(
        [Chunk.of_sequence(a, blocks_a, 16), Chunk.of_sequence(b, blocks_b, 8)]
    ).logits
    assert step1.shape == (1, runner.vocab_size) and step2.shape == (2, runner.vocab_size)
    alone_a = runner.execute([Chunk.of_sequence(a, blocks[20:26])]).logits[0]
    alone_b = runner.execute([Chunk.of_sequence(b, blocks[26:29])]).logits[0]
    torch.testing.assert_close(step2[0], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step2[1], alone_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step1[0], hf_logits(hf, b[:8])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step2[0], hf_logits(hf, a)[-1], atol=1e-4, rtol=1e-4)


def test_eager_warm_up_runs_a_mixed_step_of_two_sampling_rows(tiny_hf_model):
    """The step a GPU runner runs before serving, so that the eager path's kernels compile then:
    a prompt chunk and a decode, each giving the logits of its next token."""
    _, path = tiny_hf_model("llama")
    runner = make_runner(path)
    assert runner._warm_up_eager().logits.shape == (2, runner.vocab_size)


def test_an_in_flight_token_takes_its_input_from_the_previous_steps_ids(tiny_hf_model):
    """Overlap scheduling: a decode whose input token is still on the device (`in_flight_row`)
    reads it from the ids given; packed with another sequence's prefill it computes what the
    known token does."""
    hf, path = tiny_hf_model("llama")
    runner = make_runner(path)
    rng = random.Random(6)
    ids = [rng.randrange(runner.vocab_size) for _ in range(13)]
    other = [rng.randrange(runner.vocab_size) for _ in range(7)]
    blocks = shuffled_blocks(runner, 30 * TPB, seed=7)
    blocks_ids, blocks_other = blocks[:4], blocks[4:6]
    runner.execute([Chunk.of_sequence(ids[:-1], blocks_ids, samples=False)])
    request = Request("r", ids[:-1], SamplingParams(), block_ids=blocks_ids)
    request.in_flight_row = 2  # ids[-1] is not on the host
    assert request.num_tokens == len(ids) and request.all_ids == ids[:-1]
    in_flight = Chunk(request, len(ids) - 1, 1, True)
    with pytest.raises(ValueError, match="in-flight ids"):
        runner.execute([in_flight])
    previous_ids = torch.tensor([5, 6, ids[-1], 8])
    logits = runner.execute(
        [Chunk.of_sequence(other, blocks_other), in_flight], previous_ids
    ).logits
    torch.testing.assert_close(logits[1], hf_logits(hf, ids)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], hf_logits(hf, other)[-1], atol=1e-4, rtol=1e-4)


def test_runner_rejects_too_few_blocks_and_too_long_sequences(tiny_hf_model):
    _, path = tiny_hf_model("llama")
    runner = make_runner(path, max_seq_len=32)
    with pytest.raises(ValueError, match="only 1 blocks"):
        runner.execute([Chunk.of_sequence(list(range(8)), [0])])
    with pytest.raises(ValueError, match="exceeds max_seq_len 32"):
        runner.execute([Chunk.of_sequence(list(range(33)), list(range(9)))])


def test_runner_sizes(tiny_hf_model):
    _, path = tiny_hf_model("llama", max_position_embeddings=256)
    runner = make_runner(path)
    assert runner.max_seq_len == 256 and runner.tokens_per_block == TPB
    assert runner.num_kv_blocks == 4 * 256 // TPB  # max_batch_size sequences
    assert runner.kv_cache.shape == (2, 2, runner.num_kv_blocks, TPB, 2, 16)
    assert make_runner(path, max_tokens_in_paged_kv_cache=50).num_kv_blocks == 13
    assert runner.dtype == torch.float32 and runner.device.type == "cpu"
    assert runner.vocab_size == 640 and runner.eos_token_ids == [2]
    _, mistral = tiny_hf_model("mistral", sliding_window=64)
    assert make_runner(mistral).max_seq_len == 1024  # the window no longer caps sequences


# ---- config ----------------------------------------------------------------------------------


def test_config_reads_transformers_and_older_formats():
    old = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 8,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "eos_token_id": [5, 6],
    }
    cfg = ModelConfig.from_dict(old)
    assert cfg.rope == RopeConfig(theta=500000.0, type="linear", factor=4.0)
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16 and cfg.eos_token_ids == [5, 6]
    new = LlamaConfig(rope_parameters=LLAMA3_ROPE, max_position_embeddings=1024).to_dict()
    rope = ModelConfig.from_dict(new).rope
    assert (rope.type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        "llama3",
        500000.0,
        8.0,
        64,
    )
    qwen = ModelConfig.from_dict({**old, "model_type": "qwen2"})
    assert qwen.qkv_bias and not qwen.o_bias


def test_config_rejects_other_architectures():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_dict({"model_type": "gpt2"})


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        {**LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
    ],
)
def test_rope_frequencies_match_transformers(rope):
    hf = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        rope_parameters=dict(rope),
        max_position_embeddings=131072,
    )
    ours = ModelConfig.from_dict(hf.to_dict())
    init = ROPE_INIT_FUNCTIONS.get(rope["rope_type"])
    expected = (
        init(hf, "cpu")[0]
        if init
        else 1.0 / rope["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128)
    )
    got = inverse_frequencies(ours.rope, 128, ours.max_position_embeddings, 8192)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

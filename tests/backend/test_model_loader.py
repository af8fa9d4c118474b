"""Resolving models (default GGUF, .gguf files, HF directories, presets) and loading weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend.attention import AttentionMetadata, get_attention_backend
from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.loading import gguf_convert
from backend.loading.model_loader import LoadSpec, build_model, iter_safetensors, load_model
from backend.loading.model_paths import default_gguf_path, resolve_model
from backend.loading.presets import PRESETS, init_random_weights
from backend.model_config import ModelConfig
from backend.models.null import NullModel
from backend.request import Chunk
from backend.runner.model_runner import ModelRunner
from backend.sampling_params import SamplingParams

TORCH = get_attention_backend("torch")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TRITONLLM_CACHE", str(root))
    return root


def test_unknown_path_names_the_path_and_what_was_expected(cache, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(str(tmp_path / "nowhere"))
    assert "nowhere" in str(e.value) and "expected 'default', a model name (" in str(e.value)
    assert "qwen2.5-coder-0.5b" in str(e.value) and "a preset name of random weights (" in str(
        e.value
    )
    assert "llama-3.2-1b" in str(e.value) and "a .gguf file or a directory with config.json" in str(
        e.value
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty.*directory with config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_random_bytes_gguf_is_rejected_without_a_cache(cache, tmp_path):
    bad = tmp_path / "noise.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=f"could not read GGUF file {bad}: not a GGUF file"):
        resolve_model(str(bad))
    assert not cache.exists() or not os.listdir(cache)


def test_truncated_gguf_leaves_no_half_written_cache(cache, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(default_gguf_path(), "rb") as f:
        truncated.write_bytes(f.read(200_000))  # valid header, cut inside the metadata
    with pytest.raises(ValueError, match=f"could not read GGUF file {truncated}"):
        resolve_model(str(truncated))
    assert os.listdir(cache) == []  # neither a cache nor a temporary dir


def test_hf_directory_sharded_loads_and_matches_transformers(tiny_hf_model, tmp_path):
    hf, path = tiny_hf_model("llama")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert resolve_model(str(sharded)) == str(sharded)
    runner = ModelRunner(
        EngineConfig(model_path=str(sharded), device="cpu", tokens_per_block=8, max_batch_size=2)
    )
    ids = list(range(3, 40))
    logits = runner.execute([Chunk.of_sequence(ids, [3, 1, 4, 0, 2])]).logits
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_load_casts_weights(tiny_hf_model):
    hf, path = tiny_hf_model("qwen2")
    model = load_model(LoadSpec(str(path), torch.device("cpu"), torch.bfloat16, TORCH, 64))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    qkv = model.model.layers[1].self_attn.qkv_proj
    k_rows = qkv.shards["k_proj"]
    torch.testing.assert_close(
        qkv.bias[k_rows[0] : sum(k_rows)], hf.model.layers[1].self_attn.k_proj.bias.bfloat16()
    )


def test_missing_unexpected_and_misshapen_weights_are_reported(tiny_hf_model):
    _, path = tiny_hf_model("llama", tie_word_embeddings=False)
    config = ModelConfig.from_dir(str(path))
    weights = dict(iter_safetensors(str(path)))
    model = build_model(config, torch.device("cpu"), torch.float32, TORCH, 64)
    incomplete = {
        k: v for k, v in weights.items() if not k.endswith("layers.1.self_attn.v_proj.weight")
    }
    with pytest.raises(
        ValueError, match="missing weights: model.layers.1.self_attn.v_proj.weight$"
    ):
        model.load_weights(incomplete.items())
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.extra.weight'"):
        model.load_weights([*weights.items(), ("model.layers.0.extra.weight", torch.zeros(1))])
    weights["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), expected \(64,\)"):
        model.load_weights(weights.items())


def test_presets_resolve_to_configs_of_the_right_shape(cache):
    path = resolve_model("llama-3.2-1b")
    cfg = ModelConfig.from_dir(path)
    assert (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    ) == (2048, 16, 32, 8, 64, 8192, 128256)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 131072
    assert (
        cfg.rope.type,
        cfg.rope.theta,
        cfg.rope.factor,
        cfg.rope.low_freq_factor,
        cfg.rope.high_freq_factor,
        cfg.rope.original_max_position_embeddings,
    ) == ("llama3", 500000.0, 32.0, 1.0, 4.0, 8192)
    cfg8 = ModelConfig.from_dir(resolve_model("llama-3.1-8b"))
    assert (
        cfg8.hidden_size,
        cfg8.num_layers,
        cfg8.num_kv_heads,
        cfg8.intermediate_size,
        cfg8.tie_word_embeddings,
        cfg8.rope.factor,
    ) == (4096, 32, 8, 14336, False, 8.0)
    assert resolve_model("llama-3.2-1b") == path and set(PRESETS) == {
        "llama-3.2-1b",
        "llama-3.1-8b",
        "gemma-3-270m-random",
        "gemma-2-2b",
        "null",
    }


@pytest.mark.parametrize("name", ["gemma-3-270m-random", "gemma-2-2b"])
def test_gemma_presets_read_as_transformers_reads_them(name):
    """The engine's config of a Gemma preset equals its config of what transformers makes of the
    same fields (layer types, rotary per layer type, soft-capping, norms)."""
    from transformers import AutoConfig

    raw = PRESETS[name]
    hf = AutoConfig.for_model(
        raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"}
    )
    ours = ModelConfig.from_dict(raw)
    assert ours == ModelConfig.from_dict(hf.to_dict())
    windows = [raw["sliding_window"] if t == "sliding_attention" else None for t in hf.layer_types]
    assert ours.layer_windows == windows and None in windows


def test_random_init_is_deterministic_and_finite_in_bf16(cache):
    # The 1B preset's layer shapes, shrunk to 2 layers and a small vocabulary to stay fast.
    raw = {**PRESETS["llama-3.2-1b"], "num_hidden_layers": 2, "vocab_size": 1000}
    config = ModelConfig.from_dict(raw)
    models = []
    for _ in range(2):
        model = build_model(config, torch.device("cpu"), torch.bfloat16, TORCH, 64)
        init_random_weights(model, seed=7)
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
    kv = torch.zeros(2, 2, 2, 32, 8, 64, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        torch.arange(40),
        torch.tensor([0, 40], dtype=torch.int32),
        torch.tensor([40], dtype=torch.int32),
        torch.tensor([[0, 1]], dtype=torch.int32),
        40,
        40,
        [40],
        [40],
    )
    with torch.inference_mode():
        logits = models[0].compute_logits(models[0](torch.arange(40), torch.arange(40), kv, meta))
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.slow
def test_default_model_converts_once_and_matches_transformers(cache, monkeypatch):
    model_dir = resolve_model("default")
    config_mtime = os.path.getmtime(os.path.join(model_dir, "config.json"))
    cfg = ModelConfig.from_dir(model_dir)
    assert (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.vocab_size,
        cfg.tie_word_embeddings,
    ) == (30, 576, 9, 3, 49152, True)
    assert [p for p in os.listdir(cache)] == [os.path.basename(model_dir)]
    with open(os.path.join(model_dir, "config.json")) as f:
        assert "quantization_config" not in json.load(f)

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "_convert", no_second_conversion)
    assert resolve_model("default") == model_dir
    assert os.path.getmtime(os.path.join(model_dir, "config.json")) == config_mtime

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[
            0, len(ids) :
        ]
    runner = ModelRunner(
        EngineConfig(model_path="default", device="cpu", max_batch_size=1, max_seq_len=256)
    )
    blocks, tokens = list(range(runner.num_kv_blocks))[::-1], list(ids)
    chunk = Chunk.of_sequence(tokens, blocks)
    for _ in range(8):
        tokens.append(int(runner.execute([chunk]).logits.argmax(-1)[0]))
        chunk = Chunk.of_sequence(tokens, blocks, len(tokens) - 1)
    assert tokens[len(ids) :] == expected.tolist()


def test_a_preset_can_carry_another_models_tokenizer_and_vocabulary(tmp_path):
    from backend.loading.presets import write_preset
    from preprocessing.tokenizer import load_tokenizer

    source = resolve_model("default")
    path = write_preset("llama-3.2-1b", str(tmp_path), tokenizer_from=source)
    assert path != write_preset("llama-3.2-1b", str(tmp_path))  # the plain preset: another dir
    cfg, src = ModelConfig.from_dir(path), ModelConfig.from_dir(source)
    assert (cfg.hidden_size, cfg.num_layers) == (2048, 16)
    assert (cfg.vocab_size, cfg.eos_token_ids) == (src.vocab_size, src.eos_token_ids)
    tokenizer = load_tokenizer(path)
    assert (
        len(tokenizer) == cfg.vocab_size
        and tokenizer.decode(tokenizer.encode("Hi there")) == "Hi there"
    )
    assert (
        write_preset("llama-3.2-1b", str(tmp_path), tokenizer_from=source) == path
    )  # written once


def test_the_null_model_answers_its_known_tokens_through_the_engine():
    from backend.models.null import null_token

    executor = Executor(
        EngineConfig(model_path="null", device="cpu", max_seq_len=64, max_batch_size=4)
    )
    try:
        prompts = [[1200, 1300, 1400], [1500] * 9]
        results = executor.generate(
            prompts, [SamplingParams(max_tokens=6), SamplingParams(max_tokens=5, min_tokens=5)]
        )
    finally:
        executor.shutdown()
    for prompt, result in zip(prompts, results):
        n = len(prompt)
        assert result["token_ids"] == [
            null_token(p) for p in range(n, n + len(result["token_ids"]))
        ]
    assert [len(r["token_ids"]) for r in results] == [6, 5]
    with pytest.raises(ValueError, match="null model needs a vocabulary of at least 3000"):
        NullModel(ModelConfig.from_dict({**PRESETS["null"], "vocab_size": 500}))


def test_a_conversion_waits_for_the_one_running_and_reuses_its_result(tmp_path, capfd):
    """Models starting together convert once: the second waits on the cache's lock, then finds
    the first one's result complete and converts nothing."""
    import fcntl
    import threading

    source = resolve_model("default")  # the shared cache's copy, converted once
    cache = tmp_path / "cache"
    cache.mkdir()
    out_dir = gguf_convert.gguf_cache_dir(default_gguf_path(), str(cache))
    lock = os.open(cache, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # "another process" is converting
    result = {}
    waiter = threading.Thread(
        target=lambda: result.update(dir=gguf_convert.convert_gguf(default_gguf_path(), str(cache)))
    )
    waiter.start()
    waiter.join(timeout=2)
    assert waiter.is_alive(), "it did not wait for the conversion in progress"
    os.symlink(source, out_dir)  # the other process finishes ...
    os.close(lock)  # ... and releases the lock
    waiter.join(timeout=30)
    assert result["dir"] == out_dir
    err = capfd.readouterr().err
    assert "Waiting for another process converting" in err and "Converting" not in err

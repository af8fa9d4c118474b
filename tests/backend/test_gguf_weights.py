"""The default model served from its GGUF with the blocks kept quantized (quantization "gguf"):
every weight de-quantizes to the cached float32 checkpoint's value bit for bit (llama.cpp's q/k
row permutation undone on rows of blocks), the resident weights are a fraction of the float32
ones, and greedy output equals the de-quantized path's on the fidelity prompts. A tiny Llama stored
as llama.cpp stores it shows which layers keep blocks (one kept type for all their parts) and that
the rest are de-quantized, every weight equal to the gguf package's de-quantized value."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from backend.attention import get_attention_backend
from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.layers import Embedding, Linear
from backend.loading.gguf_weights import GGUFTensor, hf_name
from backend.loading.model_loader import LoadSpec, load_gguf_tensors, load_model, weight_bytes
from backend.loading.model_paths import default_gguf_path, kept_gguf, resolve_model
from backend.model_config import ModelConfig
from backend.models.hf_weights import weight_targets
from backend.sampling_params import SamplingParams
from tests.backend.test_engine_fidelity import PROMPTS, chat_ids

pytest.importorskip("gguf")
CPU = torch.device("cpu")


def test_gguf_names_map_to_hugging_face_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.0.attn_sinks.weight'"):
        hf_name("blk.0.attn_sinks.weight")
    # Gemma 2/3: llama.cpp's ffn_norm is the norm before the feed-forward, not after attention
    assert hf_name("blk.0.ffn_norm.weight", "gemma3") == (
        "model.layers.0.pre_feedforward_layernorm.weight"
    )
    assert hf_name("blk.1.post_attention_norm.weight", "gemma3") == (
        "model.layers.1.post_attention_layernorm.weight"
    )
    assert hf_name("blk.2.post_ffw_norm.weight", "gemma2") == (
        "model.layers.2.post_feedforward_layernorm.weight"
    )
    assert hf_name("blk.3.attn_k_norm.weight", "gemma3") == "model.layers.3.self_attn.k_norm.weight"


def test_which_models_keep_gguf_blocks(tiny_hf_model):
    _, directory = tiny_hf_model("llama")
    assert kept_gguf("default") is None
    assert kept_gguf("default", "gguf") == kept_gguf("default", "auto") == default_gguf_path()
    assert kept_gguf(str(directory), "auto") is None
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf model or 'default'"):
        kept_gguf(str(directory), "gguf")


def test_the_repositorys_tokenizer_comes_from_the_directory_without_weights():
    from ensemble.params import tokenizer_dir

    config_dir = resolve_model("default", "gguf")
    assert tokenizer_dir({"model_path": "default", "quantization": "gguf"}) == config_dir
    assert os.path.isfile(os.path.join(config_dir, "tokenizer.json"))


@pytest.mark.slow
def test_kept_blocks_are_the_float32_checkpoints_weights():
    config_dir = resolve_model("default", "gguf")
    float_dir = resolve_model("default")
    config = ModelConfig.from_dir(config_dir)
    assert config == ModelConfig.from_dir(float_dir)
    assert not any(p.endswith(".safetensors") for p in os.listdir(config_dir))
    attention = get_attention_backend("torch", CPU)
    kept = load_model(
        LoadSpec(config_dir, CPU, torch.float32, attention, 64, config, default_gguf_path())
    )
    dense = load_model(LoadSpec(float_dir, CPU, torch.float32, attention, 64, config))
    layers = [m for m in kept.modules() if isinstance(m, Linear)]
    assert all(m.quant_type == "Q4_1" for m in layers if m is not kept.lm_head)
    assert kept.lm_head.qweight is kept.model.embed_tokens.qweight  # tied: one copy of the blocks
    for name, module in kept.named_modules():
        if isinstance(module, Linear):
            assert torch.equal(module.dense_weight(torch.float32), dense.get_submodule(name).weight)
        elif isinstance(module, Embedding):
            assert module.quant_type == "Q8_0"
            ids = torch.arange(config.vocab_size)
            assert torch.equal(module(ids), dense.get_submodule(name).weight)
    for name, param in kept.named_parameters():  # norms: de-quantized, as in the checkpoint
        assert torch.equal(param, dense.get_parameter(name)), name
    assert weight_bytes(kept) < weight_bytes(dense) / 5


@pytest.mark.slow
def test_default_model_kept_quantized_generates_what_the_dequantized_one_does():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default", "gguf"))
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [chat_ids(tokenizer, p) for p in PROMPTS]
    outputs, sizes = {}, {}
    for quantization in ("none", "gguf"):
        executor = Executor(
            EngineConfig(device="cpu", quantization=quantization, max_batch_size=16)
        )
        try:
            results = executor.generate(prompts, SamplingParams(max_tokens=32), timeout=900)
            sizes[quantization] = executor.runner.weight_bytes
        finally:
            executor.shutdown()
        assert not any(r["error"] for r in results)
        outputs[quantization] = [r["token_ids"] for r in results]
    assert outputs["gguf"] == outputs["none"]
    assert sum(map(len, outputs["gguf"])) > 8 * len(prompts)  # real continuations
    assert sizes["gguf"] < 120e6 < 500e6 < sizes["none"]


# A tiny Llama stored as llama.cpp would store it: q and k rows permuted, each tensor in a type
# chosen to cover every case of keeping blocks.
TYPES = {
    "embed_tokens": "Q8_0",
    "q_proj": "Q8_0",
    "k_proj": "Q8_0",
    "v_proj": "Q8_0",
    "o_proj": "Q4_0",
    "gate_proj": "Q4_1",
    "up_proj": "Q4_1",
    "down_proj": "Q5_0",
    "lm_head": "Q4_1",  # untied: a head of its own
}


def _llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(rows.shape)
    )


def test_a_gguf_keeps_the_blocks_it_can_and_de_quantizes_the_rest(tiny_hf_model):
    import gguf

    hf_model, directory = tiny_hf_model("llama")
    config = ModelConfig.from_dir(directory)
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    tensors, expected = [], {}
    for name, weight in hf_model.state_dict().items():
        kind = name.split(".")[-2]
        quant_type = TYPES.get(kind, "F32")
        if name == "model.layers.0.self_attn.v_proj.weight":
            quant_type = "Q5_1"  # decoded by the gguf package only: this q|k|v stays dense
        if name == "model.layers.1.mlp.up_proj.weight":
            quant_type = "Q8_0"  # gate|up of two types: dense
        values = weight.float().numpy()
        stored = _llama_cpp_permute(values, heads[kind]) if kind in heads else values
        data = gguf.quants.quantize(stored, gguf.GGMLQuantizationType[quant_type])
        tensors.append(GGUFTensor(name, quant_type, data, tuple(values.shape), heads.get(kind)))
        dense = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[quant_type])
        expected[name] = torch.from_numpy(
            _unpermuted(dense, heads[kind]) if kind in heads else dense
        )
    attention = get_attention_backend("torch", CPU)
    model, kept = load_gguf_tensors(tensors, config, CPU, torch.float32, attention, 64)
    assert kept == {"Q8_0": 2, "Q4_0": 2, "Q4_1": 2, "Q5_0": 2}
    layers = model.model.layers
    assert [layers[i].self_attn.qkv_proj.quant_type for i in (0, 1)] == [None, "Q8_0"]
    assert layers[0].self_attn.o_proj.quant_type == "Q4_0"
    assert [layers[i].mlp.gate_up_proj.quant_type for i in (0, 1)] == ["Q4_1", None]
    assert model.lm_head.quant_type == "Q4_1"
    for hf, (param, rows) in weight_targets_of(model).items():
        module = model.get_submodule(param.rpartition(".")[0])
        if isinstance(module, Embedding):
            got = module(torch.arange(config.vocab_size))
        elif param.endswith(".weight") and isinstance(module, Linear):
            got = module.dense_weight(torch.float32)
        else:
            got = model.get_parameter(param)
        if rows is not None:
            got = got.narrow(0, *rows)
        assert torch.equal(got, expected[hf].reshape(got.shape)), hf


def _unpermuted(rows: np.ndarray, heads: int) -> np.ndarray:
    return (
        rows.reshape(heads, rows.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)
    )


def weight_targets_of(model) -> dict:
    """Hugging Face name -> (our parameter name, rows), kept-quantized layers included."""
    targets = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quant_type is not None:
            parent = name.rpartition(".")[0]
            for projection, rows in (module.shards or {name.rpartition(".")[2]: None}).items():
                hf = f"{parent}.{projection}.weight" if module.shards else f"{name}.weight"
                targets[hf] = (f"{name}.weight", rows)
        elif isinstance(module, Embedding) and module.quant_type is not None:
            targets[f"{name}.weight"] = (f"{name}.weight", None)
    return {**weight_targets(model), **targets}


def test_building_a_repository_refuses_gguf_for_a_directory(tiny_hf_model, tmp_path, capsys):
    from ensemble.__main__ import main

    _, directory = tiny_hf_model("llama")
    argv = ["build", "--out", str(tmp_path / "r"), "--model", str(directory)]
    with pytest.raises(SystemExit):
        main(argv + ["--quantization", "gguf"])
    assert "quantization 'gguf' needs a .gguf model or 'default'" in capsys.readouterr().err
    assert main(argv + ["--quantization", "auto"]) == 0  # auto: the directory's own weights

"""Adapters this engine cannot serve are refused at start with the field and the rule; a request
naming an unregistered adapter is refused alone."""

from __future__ import annotations

import json
import shutil

import pytest

from backend import generate
from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.lora.peft_adapter import LoraAdapterError
from backend.sampling_params import SamplingParams
from tests.lora.peft_adapters import ALL_PROJECTIONS, save_peft_adapter
from tests.tiny_models import save_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama and a rank-8 adapter of it: (root, model dir, adapter dir)."""
    root = tmp_path_factory.mktemp("lora-errors")
    save_tiny_hf_model(root / "base", "llama")
    save_peft_adapter(
        root / "base", root / "good", 0, std=0.1, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS
    )
    return root, root / "base", root / "good"


def start(model_dir, adapter_dir, **config) -> Executor:
    return Executor(
        EngineConfig(
            model_path=str(model_dir), device="cpu", lora_modules=f"x={adapter_dir}", **config
        )
    )


def broken_copy(root, adapter_dir, name: str):
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(adapter_dir, path)
    return path


def test_rank_above_max_lora_rank(tiny):
    _, model_dir, adapter = tiny
    with pytest.raises(LoraAdapterError, match="r 8 exceeds max_lora_rank 4"):
        start(model_dir, adapter, max_lora_rank=4)


def test_unknown_target_module(tiny):
    root, model_dir, adapter = tiny
    path = broken_copy(root, adapter, "unknown-target")
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "lm_head"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraAdapterError, match="target_modules names 'lm_head'"):
        start(model_dir, path)


def test_shapes_of_another_model(tiny, tmp_path):
    """An adapter made for a wider model, and one for a deeper model."""
    root, model_dir, _ = tiny
    for name, overrides, message in (
        ("wider", dict(hidden_size=96), r"has lora_A \(8, 96\).*needs \[r, 64\]"),
        ("deeper", dict(num_hidden_layers=3), "adapts module 'model.layers.2.self_attn.q_proj'"),
    ):
        save_tiny_hf_model(tmp_path / f"{name}-base", "llama", **overrides)
        adapter = tmp_path / name
        save_peft_adapter(
            tmp_path / f"{name}-base",
            adapter,
            0,
            std=0.1,
            r=8,
            lora_alpha=8,
            target_modules=["q_proj"],
        )
        with pytest.raises(LoraAdapterError, match=message):
            start(model_dir, adapter)


def test_missing_and_corrupt_files(tiny):
    root, model_dir, adapter = tiny
    path = broken_copy(root, adapter, "no-weights")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraAdapterError, match="no adapter_model.safetensors"):
        start(model_dir, path)
    path = broken_copy(root, adapter, "corrupt-weights")
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors cannot be read"):
        start(model_dir, path)
    path = broken_copy(root, adapter, "corrupt-config")
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraAdapterError, match="adapter_config.json is not valid JSON"):
        start(model_dir, path)
    with pytest.raises(LoraAdapterError, match="not a directory"):
        start(model_dir, root / "nowhere")


def test_lora_modules_rules():
    with pytest.raises(ValueError, match="lora_modules must be NAME=DIR pairs"):
        EngineConfig(lora_modules="a=/x,a=/y")
    with pytest.raises(ValueError, match="lora_modules must be NAME=DIR pairs"):
        EngineConfig(lora_modules="justaname")
    with pytest.raises(ValueError, match="registers 3 adapters; max_loras is 2"):
        EngineConfig(lora_modules="a=/x b=/y c=/z", max_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        EngineConfig(max_lora_rank=0)
    assert EngineConfig(lora_modules="a=/x, b=/y").lora_adapters() == {"a": "/x", "b": "/y"}


def test_tensor_parallel_refused(tiny):
    _, model_dir, adapter = tiny
    with pytest.raises(ValueError, match="lora_modules needs tensor_parallel_size 1"):
        start(model_dir, adapter, tensor_parallel_size=2)


def test_offline_command_takes_an_adapter(tiny):
    _, model_dir, adapter = tiny
    args = generate.parse_args(
        ["--model", str(model_dir), "--lora-modules", f"x={adapter}", "--lora-name", "x"]
        + ["--prompt", "hi"]
    )
    assert generate.engine_config(args).lora_adapters() == {"x": str(adapter)}
    assert generate.sampling_params(args).lora_name == "x"


def test_unknown_lora_name_fails_that_request_alone(tiny):
    _, model_dir, adapter = tiny
    executor = start(model_dir, adapter)
    try:
        with pytest.raises(ValueError, match="lora_name 'y' is not a registered LoRA adapter"):
            executor.submit("bad", [5, 6, 7], SamplingParams(lora_name="y"), lambda out: None)
        good = SamplingParams(max_tokens=4, ignore_end_id=True, lora_name="x")
        result = executor.generate([[5, 6, 7]], good, timeout=60)[0]
        assert result["error"] is None and len(result["token_ids"]) == 4
    finally:
        executor.shutdown()

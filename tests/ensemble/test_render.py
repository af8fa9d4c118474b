"""Rendering: real values, the checked-in repository is what the defaults render, build copies
code."""

from __future__ import annotations

import pytest

from ensemble.build import SOURCE_REPOSITORY, build_repository, stale_configs
from ensemble.params import engine_kwargs, parameters
from ensemble.render import MODEL_NAMES, render_configs
from ensemble.settings import ENGINE_FIELDS, ServeSettings
from tests.adapters import rendered_parameters


def test_checked_in_repository_is_what_the_defaults_render():
    assert stale_configs(ServeSettings()) == []


def test_no_placeholders_and_every_engine_parameter_rendered():
    configs = render_configs(ServeSettings())
    for text in configs.values():
        assert "${" not in text
    llm = rendered_parameters(configs["tensorrt_llm"])
    for name in ENGINE_FIELDS + (
        "exclude_input_in_output",
        "default_max_tokens",
        "cancellation_check_period_ms",
        "stats_check_period_ms",
    ):
        assert name in llm, name


def test_settings_reach_the_configs():
    s = ServeSettings(
        model_path="/models/llama",
        max_batch_size=8,
        max_seq_len=512,
        max_tokens_in_paged_kv_cache=4096,
        enable_kv_cache_reuse=False,
        batch_scheduler_policy="max_utilization",
        triton_max_batch_size=16,
        preprocessing_instance_count=3,
        bls_instance_count=2,
        default_max_tokens=7,
    )
    configs = render_configs(s)
    llm = rendered_parameters(configs["tensorrt_llm"])
    assert llm["model_path"] == "/models/llama"
    assert llm["max_batch_size"] == "8"
    assert llm["max_seq_len"] == "512"
    assert llm["max_tokens_in_paged_kv_cache"] == "4096"
    assert llm["enable_kv_cache_reuse"] == "false"
    assert llm["batch_scheduler_policy"] == "max_utilization"
    assert llm["tokens_per_block"] == "auto"
    assert rendered_parameters(configs["preprocessing"])["default_max_tokens"] == "7"
    for name in MODEL_NAMES:
        assert "max_batch_size: 16\n" in configs[name]
    assert "count: 3" in configs["preprocessing"]
    assert "count: 2" in configs["tensorrt_llm_bls"]
    assert "decoupled: true" in configs["tensorrt_llm"]
    assert "decoupled: true" in configs["tensorrt_llm_bls"]
    # streamed pieces stay in order: one instance unbatched, or batched with preserve_ordering
    assert (
        "dynamic_batching" not in configs["postprocessing"]
        and "count: 1" in configs["postprocessing"]
    )
    batched = render_configs(
        ServeSettings(postprocessing_batching=True, postprocessing_instance_count=4)
    )["postprocessing"]
    assert "preserve_ordering: true" in batched and "allow_ragged_batch: true" in batched
    assert "count: 4" in batched


def test_decoupled_mode_and_chat_template_settings():
    default = render_configs(ServeSettings())
    assert "model_transaction_policy" not in default["ensemble"]  # Triton infers it
    assert rendered_parameters(default["preprocessing"])["apply_chat_template"] == "false"
    plain = render_configs(ServeSettings(decoupled_mode=False, apply_chat_template=True))
    for name in ("tensorrt_llm", "tensorrt_llm_bls"):
        assert "model_transaction_policy {\n  decoupled: false\n}" in plain[name]
        assert "decoupled: true" in default[name]
    assert "model_transaction_policy" not in plain["ensemble"]
    for name in ("preprocessing", "postprocessing"):
        assert "decoupled" not in plain[name]
    assert rendered_parameters(plain["preprocessing"])["apply_chat_template"] == "true"


def test_rendered_parameters_read_back_as_engine_config():
    s = ServeSettings(
        max_batch_size=8,
        max_seq_len=512,
        kv_cache_free_gpu_mem_fraction=0.5,
        enable_chunked_context=False,
        device="cpu",
    )
    text = render_configs(s)["tensorrt_llm"]
    params = {k: v for k, v in rendered_parameters(text).items()}
    kwargs = engine_kwargs(params)
    assert kwargs["max_batch_size"] == 8 and kwargs["max_seq_len"] == 512
    assert kwargs["kv_cache_free_gpu_mem_fraction"] == 0.5
    assert kwargs["enable_chunked_context"] is False and kwargs["device"] == "cpu"
    assert "tokens_per_block" not in kwargs and "tokenizer_dir" not in kwargs
    from backend.config import EngineConfig

    EngineConfig(**kwargs).validate()


def test_parameters_from_model_config_json():
    config = '{"parameters": {"a": {"string_value": "1"}, "b": {"string_value": "${x}"}}}'
    params = parameters(config)
    assert params == {"a": "1", "b": "${x}"}
    assert engine_kwargs({"max_batch_size": "${triton_max_batch_size}"}) == {}
    with pytest.raises(ValueError, match="parameter max_batch_size must be an integer"):
        engine_kwargs({"max_batch_size": "many"})
    with pytest.raises(ValueError, match="parameter enable_kv_cache_reuse must be true or false"):
        engine_kwargs({"enable_kv_cache_reuse": "maybe"})


def test_invalid_settings_are_named():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        render_configs(ServeSettings(max_batch_size=0))
    with pytest.raises(ValueError, match="kv_cache_free_gpu_mem_fraction must be in"):
        ServeSettings(kv_cache_free_gpu_mem_fraction=1.5).validate()
    with pytest.raises(ValueError, match="batch_scheduler_policy must be one of"):
        ServeSettings(batch_scheduler_policy="fifo").validate()
    with pytest.raises(ValueError, match="must differ"):
        ServeSettings(http_port=9000, grpc_port=9000).validate()


def test_build_writes_configs_and_copies_model_code(tmp_path):
    out = build_repository(ServeSettings(max_batch_size=4), tmp_path / "repo")
    for name in MODEL_NAMES:
        assert (out / name / "config.pbtxt").exists()
        assert (out / name / "1").is_dir()
    assert (out / "tensorrt_llm" / "1" / "model.py").read_text() == (
        SOURCE_REPOSITORY / "tensorrt_llm" / "1" / "model.py"
    ).read_text()
    assert 'string_value: "4"' in (out / "tensorrt_llm" / "config.pbtxt").read_text()
    assert not list(out.rglob("__pycache__"))
    # building again over an existing repository replaces it cleanly
    build_repository(ServeSettings(max_batch_size=5), out)
    assert 'string_value: "5"' in (out / "tensorrt_llm" / "config.pbtxt").read_text()


def test_cli_build_and_check(tmp_path, capsys):
    from ensemble.__main__ import main

    assert (
        main(
            [
                "build",
                "--out",
                str(tmp_path / "r"),
                "--max-batch-size",
                "3",
                "--enable-kv-cache-reuse",
                "false",
                "--max-seq-len",
                "256",
            ]
        )
        == 0
    )
    text = (tmp_path / "r" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert rendered_parameters(text)["max_batch_size"] == "3"
    assert rendered_parameters(text)["enable_kv_cache_reuse"] == "false"
    assert main(["check"]) == 0
    with pytest.raises(SystemExit):
        main(["build", "--out", str(tmp_path / "r"), "--max-batch-size", "0"])

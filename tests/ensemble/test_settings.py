"""ServeSettings are EngineConfig's fields plus the repository's: every engine knob is served with
the engine's default, rendered as a tensorrt_llm parameter and read back unchanged; both are
checked when made and frozen, and a bad value is refused naming the field and the rule."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from backend.config import CHOICES, EngineConfig
from backend.validation import field_types
from ensemble.__main__ import _add_settings_options, settings_from_args
from ensemble.params import engine_kwargs, get_setting
from ensemble.render import render_configs
from ensemble.settings import ENGINE_FIELDS, ServeSettings
from tests.adapters import rendered_parameters


def other_value(name: str):
    """A valid value of an engine field that differs from its default."""
    kind, _ = field_types(EngineConfig)[name]
    default = getattr(EngineConfig(), name)
    if name == "quantization":  # a format quantize_lm_head's other value (true) accepts
        return "fp8"
    if name == "overlap_scheduling":  # off: speculative_method's other value (ngram) needs it
        return False
    if name in CHOICES:
        return next(c for c in CHOICES[name] if c != default)
    if kind is bool:
        return not default
    if kind is int:
        return (default or 1) + 3
    if kind is float:
        return default / 2
    if name == "max_attention_window_size":
        return "4096,1024"
    if name == "lora_modules":
        return "other=/other/lora_modules"
    if name == "gpu_device_ids":  # one per rank of tensor_parallel_size's other value
        return ",".join(map(str, range(other_value("tensor_parallel_size"))))
    return f"/other/{name}"


def test_every_engine_field_is_a_setting_with_the_engines_default():
    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    served = {f.name: f for f in dataclasses.fields(ServeSettings)}
    assert ENGINE_FIELDS == tuple(engine)
    for name, f in engine.items():
        assert name in served, name
        assert served[name].default == f.default, name
        assert served[name].type == f.type, name
    assert "overlap_scheduling" in ENGINE_FIELDS  # once missing from the hand-written list


def test_every_engine_field_is_rendered_and_read_back():
    values = {name: other_value(name) for name in ENGINE_FIELDS}
    settings = ServeSettings(**values)
    params = rendered_parameters(render_configs(settings)["tensorrt_llm"])
    assert set(ENGINE_FIELDS) <= set(params)
    assert (
        EngineConfig(**engine_kwargs(params)) == settings.engine_config() == EngineConfig(**values)
    )
    defaults = rendered_parameters(render_configs(ServeSettings())["tensorrt_llm"])
    assert EngineConfig(**engine_kwargs(defaults)) == EngineConfig()


def test_every_setting_is_a_command_line_option():
    parser = argparse.ArgumentParser()
    _add_settings_options(parser)
    argv = []
    for name in ENGINE_FIELDS:
        value = other_value(name)
        text = str(value).lower() if isinstance(value, bool) else str(value)
        argv += ["--model" if name == "model_path" else "--" + name.replace("_", "-"), text]
    settings = settings_from_args(parser.parse_args(argv))
    assert settings.engine_config() == EngineConfig(**{n: other_value(n) for n in ENGINE_FIELDS})


def test_unset_parameters_read_as_the_settings_defaults():
    defaults = ServeSettings()
    for name in (
        "default_max_tokens",
        "exclude_input_in_output",
        "apply_chat_template",
        "skip_special_tokens",
        "cancellation_check_period_ms",
        "model_path",
    ):
        assert get_setting({}, name) == getattr(defaults, name)
        assert get_setting({name: "auto"}, name) == getattr(defaults, name)
    assert get_setting({"default_max_tokens": "7"}, "default_max_tokens") == 7
    # where "auto" is one of a field's choices but not its default, it is read as itself
    assert get_setting({"quantization": "auto"}, "quantization") == "auto"
    assert get_setting({"quantization": ""}, "quantization") == defaults.quantization == "none"
    assert get_setting({"attention_backend": "auto"}, "attention_backend") == "auto"
    assert get_setting({"kv_cache_dtype": "fp8"}, "kv_cache_dtype") == "fp8"
    assert get_setting({"kv_cache_dtype": "auto"}, "kv_cache_dtype") == "auto"
    with pytest.raises(ValueError, match="parameter skip_special_tokens must be true or false"):
        get_setting({"skip_special_tokens": "perhaps"}, "skip_special_tokens")


@pytest.mark.parametrize("cls", [EngineConfig, ServeSettings])
@pytest.mark.parametrize(
    "name, value, message",
    [
        ("max_batch_size", 0, "max_batch_size must be >= 1, got 0"),
        ("max_batch_size", "8", "max_batch_size must be an integer, got '8'"),
        ("max_seq_len", 1.5, "max_seq_len must be an integer, got 1.5"),
        ("max_queue_size", -1, "max_queue_size must be >= 0, got -1"),
        ("enable_kv_cache_reuse", "yes", "enable_kv_cache_reuse must be true or false, got 'yes'"),
        ("overlap_scheduling", 1, "overlap_scheduling must be true or false, got 1"),
        ("cuda_graphs", None, "cuda_graphs must be true or false, got None"),
        ("device", "", "device must be a non-empty string, got ''"),
        (
            "kv_cache_free_gpu_mem_fraction",
            0.0,
            r"kv_cache_free_gpu_mem_fraction must be in \(0, 1\]",
        ),
        ("kv_cache_free_gpu_mem_fraction", True, "kv_cache_free_gpu_mem_fraction must be a number"),
        ("batch_scheduler_policy", "fifo", "batch_scheduler_policy must be one of"),
        ("attention_backend", "flash", "attention_backend must be one of"),
        ("quantization", "int3", "quantization must be one of"),
        ("kv_cache_dtype", "fp16", "kv_cache_dtype must be one of"),
    ],
)
def test_a_bad_engine_value_is_refused_naming_the_field(cls, name, value, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        cls(**{name: value})


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("default_max_tokens", 0, "default_max_tokens must be >= 1, got 0"),
        ("decoupled_mode", "false", "decoupled_mode must be true or false, got 'false'"),
        ("http_port", 70000, "http_port must be <= 65535, got 70000"),
        ("max_queue_delay_microseconds", -5, "max_queue_delay_microseconds must be >= 0, got -5"),
    ],
)
def test_a_bad_repository_value_is_refused_naming_the_field(name, value, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        ServeSettings(**{name: value})


def test_a_made_config_cannot_change():
    config, settings = EngineConfig(max_batch_size=8), ServeSettings(max_batch_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.default_max_tokens = 0
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        dataclasses.replace(config, max_batch_size=0)
    assert config.max_batch_size == settings.max_batch_size == 8


def test_a_bad_parameter_in_a_config_is_refused_naming_it():
    with pytest.raises(ValueError, match="max_num_tokens must be >= 1, got 0"):
        EngineConfig(**engine_kwargs({"max_num_tokens": "0"}))
    with pytest.raises(ValueError, match="parameter overlap_scheduling must be true or false"):
        engine_kwargs({"overlap_scheduling": "sometimes"})

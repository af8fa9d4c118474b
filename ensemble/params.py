"""Reading config.pbtxt `parameters` back into typed values (used by the models' initialize()).

Each parameter is the `ServeSettings` field of its name: read as that field's type, its default
when unset. "auto", "" and an unfilled "${...}" placeholder all mean unset, except where "auto" is
one of the field's choices. A value that does not parse is an error naming the parameter, not a
silent default.
"""

from __future__ import annotations

import json

from backend.config import CHOICES
from backend.validation import field_types
from ensemble.settings import ENGINE_FIELDS, ServeSettings

_TRUE = ("true", "1", "yes", "y", "t", "on")
_FALSE = ("false", "0", "no", "n", "f", "off")


def parameters(model_config: str | dict) -> dict[str, str]:
    """`args["model_config"]` (JSON text or dict) -> {key: string_value}."""
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    raw = config.get("parameters", {}) or {}
    return {key: str(value.get("string_value", "")) for key, value in raw.items()}


def is_unset(text: str | None) -> bool:
    return text is None or text.strip() in ("", "auto") or text.strip().startswith("${")


def get_str(params: dict[str, str], key: str) -> str | None:
    text = params.get(key)
    return None if is_unset(text) else text.strip()


def get_int(params: dict[str, str], key: str) -> int | None:
    text = get_str(params, key)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"parameter {key} must be an integer, got {text!r}") from None


def get_float(params: dict[str, str], key: str) -> float | None:
    text = get_str(params, key)
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"parameter {key} must be a number, got {text!r}") from None


def get_bool(params: dict[str, str], key: str) -> bool | None:
    text = get_str(params, key)
    if text is None:
        return None
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"parameter {key} must be true or false, got {text!r}")


_READERS = {bool: get_bool, int: get_int, float: get_float, str: get_str}
_DEFAULTS = ServeSettings()


def _read(params: dict[str, str], name: str):
    """The parameter as its ServeSettings field's type; None when unset. "auto" is a value, not
    unset, for a field that has it among its choices (`quantization`: auto is not its default)."""
    text = params.get(name)
    if text is not None and text.strip() == "auto" and "auto" in CHOICES.get(name, ()):
        return "auto"
    return _READERS[field_types(ServeSettings)[name][0]](params, name)


def get_setting(params: dict[str, str], name: str):
    """The parameter of a ServeSettings field, or that field's default when unset."""
    value = _read(params, name)
    return getattr(_DEFAULTS, name) if value is None else value


def engine_kwargs(params: dict[str, str]) -> dict:
    """The set engine parameters as keyword arguments of backend.config.EngineConfig."""
    values = {name: _read(params, name) for name in ENGINE_FIELDS}
    return {name: value for name, value in values.items() if value is not None}


def tokenizer_dir(params: dict[str, str]) -> str:
    """The `tokenizer_dir` parameter, else the directory the engine loads `model_path` from
    (resolving "default" or a .gguf imports the engine's loader, so only when needed)."""
    explicit = get_setting(params, "tokenizer_dir")
    if explicit:
        return explicit
    from backend.loading.model_paths import resolve_model  # only when needed

    return resolve_model(get_setting(params, "model_path"), get_setting(params, "quantization"))

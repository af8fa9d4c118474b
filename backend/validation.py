"""Field checks shared by the engine's configuration and request parameters: each error names
the field and the rule, e.g. `max_tokens must be >= 1, got 0`."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing


def check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def check_token(name: str, token, vocab_size: int | None) -> None:
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"{name} token ids must be integers, got {token!r}")
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {token}")


@functools.cache
def field_types(cls) -> dict[str, tuple[type, bool]]:
    """A dataclass's fields from its annotations: name -> (type, whether None is allowed)."""
    hints = typing.get_type_hints(cls)
    types = {}
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        kinds = [a for a in args if a is not type(None)]
        types[f.name] = (kinds[0], len(kinds) < len(args))
    return types


_RULE = {bool: "true or false", int: "an integer", float: "a number", str: "a non-empty string"}


def check_fields(obj) -> None:
    """Every field of a dataclass instance holds a value of its annotated type (a bool is not an
    int; an int is a float; a string is not empty; None only where the annotation allows it)."""
    for name, (kind, optional) in field_types(type(obj)).items():
        value = getattr(obj, name)
        if value is None and optional:
            continue
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok or value == "":
            raise ValueError(f"{name} must be {_RULE[kind]}, got {value!r}")

"""Command-line options from a config dataclass: one `--field-name` per field, typed from its
annotation, defaulting to None (the dataclass's own default). Every command that builds an
`EngineConfig` (the offline command, `python -m ensemble build|serve`) takes its options from
here, so a field added to the config reaches all of them."""

from __future__ import annotations

import argparse
from dataclasses import fields


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_config_options(
    parser: argparse.ArgumentParser, config_type: type, skip: tuple[str, ...] = ()
) -> None:
    """`--model` for `model_path`, and `--field-name` for every other field not in `skip`."""
    parser.add_argument(
        "--model",
        dest="model_path",
        default=None,
        help="'default', a model by name (gemma-3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b: "
        "docs/models.md), a preset, a Hugging Face directory or a .gguf file",
    )
    for f in fields(config_type):
        if f.name == "model_path" or f.name in skip:
            continue
        kind = str(f.type)
        convert = (
            parse_bool
            if kind.startswith("bool")
            else int
            if kind.startswith("int")
            else float
            if kind.startswith("float")
            else str
        )
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=convert,
            default=None,
            help=f"(default: {f.default})",
        )


def given_fields(args: argparse.Namespace, config_type: type) -> dict:
    """The fields of `config_type` the command line set (the rest keep their defaults)."""
    return {
        f.name: getattr(args, f.name)
        for f in fields(config_type)
        if getattr(args, f.name, None) is not None
    }

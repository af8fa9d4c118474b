"""Stop words, bad words and embedding bias: from client strings to token ids.

TensorRT-LLM passes word lists to the LLM as one int32 array of shape [2, N]: row 0 holds the
token ids of all words back to back, row 1 the cumulative end offset of each word; ids are
padded with 0 and offsets with -1 up to N. No words is shape [2, 0]. Example, words [5, 6] and
[7]: ``[[5, 6, 7], [2, 3, -1]]``.

Parsing the ensemble's ``bad_words`` / ``stop_words`` STRING tensor (``parse_words``):
  - one element: a comma-separated list, as TensorRT-LLM clients send it ("Human:,Assistant:").
    Nothing is trimmed. A word that contains a comma is written in double quotes, with ``""``
    for a quote inside it: ``"Hello, world",bye`` is two words.
  - several elements: one word each, taken verbatim (no splitting).
  Empty words are ignored, so ``""`` (what perf_analyzer sends) means no words.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

from preprocessing.tokenizer import encode

# Per list and request: each word is tokenized in the preprocessing model, ahead of the
# requests queued behind it, so a list must stay cheap.
MAX_WORDS = 256
MAX_WORD_CHARS = 1024


def parse_words(strings, field: str = "words") -> list[str]:
    """Words from a STRING tensor's elements (str or UTF-8 bytes); see the module docstring.
    Raises ValueError past MAX_WORDS words or MAX_WORD_CHARS characters in a word."""
    if strings is None:
        return []
    if isinstance(strings, (str, bytes)):
        strings = [strings]
    elements = np.asarray(strings, dtype=object).ravel()
    if elements.size > MAX_WORDS:
        raise ValueError(f"{field} has {elements.size} words; at most {MAX_WORDS} are allowed")
    elements = [_as_text(element, field) for element in elements]
    words = _split_commas(elements[0], field) if len(elements) == 1 else elements
    words = [word for word in words if word]
    if len(words) > MAX_WORDS:
        raise ValueError(f"{field} has {len(words)} words; at most {MAX_WORDS} are allowed")
    for word in words:
        if len(word) > MAX_WORD_CHARS:
            raise ValueError(
                f"{field}: a word of {len(word)} characters; at most {MAX_WORD_CHARS} are allowed"
            )
    return words


def encode_word_list(tokenizer, words: Sequence[str]) -> np.ndarray:
    """Words as TensorRT-LLM's int32 [2, N] ids + offsets array.

    BPE tokenizers fold the space before a word into the word's first token, so "Hello"
    mid-sentence is the token " Hello", not "Hello". A stop or bad word is therefore encoded as
    given and, unless it starts with a space, also with a leading space; both sequences go into
    the list (once each if they coincide). TensorRT-LLM encodes the word only as given.
    """
    sequences: list[list[int]] = []
    for word in words:
        if not word:
            continue
        variants = [word] if word.startswith(" ") else [word, " " + word]
        for variant in variants:
            ids = encode(tokenizer, variant, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return word_list_array(sequences)


def word_list_array(sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """Token sequences (each non-empty) as an int32 [2, N] ids + offsets array."""
    if any(len(sequence) == 0 for sequence in sequences):
        raise ValueError("word list sequences must not be empty")
    flat = [int(token) for sequence in sequences for token in sequence]
    offsets = np.cumsum([len(sequence) for sequence in sequences], dtype=np.int64)
    array = np.zeros((2, len(flat)), dtype=np.int32)
    array[0, :] = flat
    array[1, :] = -1
    array[1, : len(offsets)] = offsets
    return array


def decode_word_list(array, field: str) -> list[list[int]]:
    """Token sequences from a [2, N] or [1, 2, N] ids + offsets array, validated strictly.

    Rules: integer dtype; shape [2, N] or [1, 2, N]; the offsets are strictly increasing, at
    least 1 and at most N, followed only by -1 padding; the ids of the words are >= 0. Padding
    ids after the last word are not read.
    """
    array = np.asarray(array)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{field} must be an integer array, got dtype {array.dtype}")
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2 or array.shape[0] != 2:
        raise ValueError(f"{field} must have shape [2, N] or [1, 2, N], got {list(array.shape)}")
    ids, offsets = array[0].tolist(), array[1].tolist()
    count = offsets.index(-1) if -1 in offsets else len(offsets)
    padding = offsets[count:]
    if any(offset != -1 for offset in padding):
        raise ValueError(
            f"{field} offsets must be followed only by -1 padding after the first -1, got {offsets}"
        )
    sequences, previous = [], 0
    for position, offset in enumerate(offsets[:count]):
        if offset <= previous:
            raise ValueError(
                f"{field} offsets must be strictly increasing and >= 1, got {offset} "
                f"at position {position} after {previous}"
            )
        if offset > len(ids):
            raise ValueError(
                f"{field} offset {offset} at position {position} is beyond the {len(ids)} token ids"
            )
        sequences.append(ids[previous:offset])
        previous = offset
    for position, token in enumerate(ids[:previous]):
        if token < 0:
            raise ValueError(f"{field} token ids must be >= 0, got {token} at position {position}")
    return sequences


def embedding_bias(
    tokenizer, words: Sequence[str], weights: Sequence[float], vocab_size: int
) -> dict[int, float]:
    """Logit bias per token id: every token of each word gets the word's weight (summed where
    words share tokens), as in TensorRT-LLM; the words are encoded without special tokens."""
    words, weights = list(words), [float(w) for w in weights]
    if len(words) != len(weights):
        raise ValueError(
            "embedding_bias_words and embedding_bias_weights must have the same length, "
            f"got {len(words)} and {len(weights)}"
        )
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights):
        if not math.isfinite(weight):
            raise ValueError(f"embedding_bias_weights must be finite, got {weight} for {word!r}")
        for token in encode(tokenizer, word, add_special_tokens=False) if word else []:
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"embedding_bias_words: {word!r} has token id {token}, outside the model's "
                    f"vocabulary of {vocab_size}"
                )
            bias[token] = bias.get(token, 0.0) + weight
    return bias


def _as_text(element: Union[str, bytes], field: str) -> str:
    if isinstance(element, str):
        return element
    if isinstance(element, (bytes, np.bytes_)):
        try:
            return bytes(element).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{field} must be valid UTF-8: {error}") from None
    raise ValueError(f"{field} must hold strings, got {type(element).__name__}")


def _split_commas(text: str, field: str) -> list[str]:
    words: list[str] = []
    position = 0
    while True:
        if text.startswith('"', position):
            word, position = _quoted(text, position, field)
            if position < len(text) and text[position] != ",":
                raise ValueError(
                    f"{field}: a quoted word must be followed by a comma or the end, "
                    f"got {text[position:]!r}"
                )
        else:
            end = text.find(",", position)
            end = len(text) if end < 0 else end
            word, position = text[position:end], end
        words.append(word)
        if position >= len(text):
            return words
        position += 1  # the comma


def _quoted(text: str, position: int, field: str) -> tuple[str, int]:
    """The word in double quotes starting at ``position`` and the index after its closing quote."""
    parts: list[str] = []
    start = position + 1
    while True:
        quote = text.find('"', start)
        if quote < 0:
            raise ValueError(f"{field}: a quoted word has no closing quote: {text[position:]!r}")
        parts.append(text[start:quote])
        if not text.startswith('"', quote + 1):
            return "".join(parts), quote + 1
        parts.append('"')
        start = quote + 2

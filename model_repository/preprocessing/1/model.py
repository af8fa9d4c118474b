"""Triton adapter of the tokenizer: text and word lists in, token ids out (TensorRT-LLM names).

Errors name the ensemble input the user sent (text_input, max_tokens, stop_words, ...).
"""

from __future__ import annotations

import numpy as np

from ensemble.environment import check_stub_numpy
from ensemble.params import get_setting, parameters, tokenizer_dir
from ensemble.request_loop import respond
from ensemble.stub_watch import dismiss, watch_stub
from ensemble.tensors import ensemble_names
from preprocessing.prompt import encode_prompt
from preprocessing.tokenizer import default_end_id, default_pad_id, load_tokenizer
from preprocessing.word_lists import embedding_bias, encode_word_list, parse_words

FIELD = ensemble_names("preprocessing")  # preprocessing input -> the ensemble input users know


class TritonPythonModel:
    def initialize(self, args):
        check_stub_numpy()
        params = parameters(args["model_config"])
        self.tokenizer = load_tokenizer(tokenizer_dir(params))
        self.add_special_tokens = get_setting(params, "add_special_tokens")
        self.default_max_tokens = get_setting(params, "default_max_tokens")
        self.apply_chat_template = get_setting(params, "apply_chat_template")
        self.vocab_size = len(self.tokenizer)
        self.end_id = default_end_id(self.tokenizer)
        self.pad_id = default_pad_id(self.tokenizer)
        self.stub_watch = watch_stub(args["model_name"])  # last: a failed load is not a death

    def finalize(self):
        dismiss(self.stub_watch)

    def execute(self, requests):
        return respond("preprocessing", requests, lambda request, inputs: self.convert(inputs))

    def convert(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if "QUERY" not in tensors:
            raise ValueError("text_input is required")
        queries = tensors["QUERY"].reshape(len(tensors["QUERY"]), -1)
        batch = len(queries)
        chat = self.chat_flags(tensors, batch)
        ids = [self.encode_query(row, use_chat) for row, use_chat in zip(queries, chat)]
        lengths = np.array([[len(x)] for x in ids], dtype=np.int32)
        input_ids = np.full((batch, max(len(x) for x in ids)), self.pad_id, dtype=np.int32)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = row
        return {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": lengths,
            "BAD_WORDS_IDS": self.word_lists(tensors, "BAD_WORDS_DICT", batch),
            "STOP_WORDS_IDS": self.word_lists(tensors, "STOP_WORDS_DICT", batch),
            "EMBEDDING_BIAS": self.bias(tensors, batch),
            "REQUEST_OUTPUT_LEN": self.scalar(
                tensors, "REQUEST_OUTPUT_LEN", batch, self.default_max_tokens, low=1
            ),
            "OUT_END_ID": self.scalar(tensors, "END_ID", batch, self.end_id, low=-1),
            "OUT_PAD_ID": self.scalar(tensors, "PAD_ID", batch, self.pad_id, low=0),
        }

    def encode_query(self, row: np.ndarray, chat: bool) -> list[int]:
        if row.size != 1:
            raise ValueError(f"text_input must hold one string per batch row, got {row.size}")
        return encode_prompt(
            self.tokenizer,
            _text(row[0], "text_input"),
            chat,
            add_special_tokens=self.add_special_tokens,
        )

    def chat_flags(self, tensors, batch: int) -> list[bool]:
        """apply_chat_template per batch row; the repository's default where not sent."""
        if "APPLY_CHAT_TEMPLATE" not in tensors:
            return [self.apply_chat_template] * batch
        values = tensors["APPLY_CHAT_TEMPLATE"].reshape(batch, -1)
        if values.shape[1] != 1 or values.dtype != np.bool_:
            raise ValueError(
                "apply_chat_template must hold one BOOL per batch row, got "
                f"{values.shape[1]} of {values.dtype}"
            )
        return [bool(v) for v in values[:, 0]]

    def scalar(self, tensors, name: str, batch: int, default: int, low: int) -> np.ndarray:
        if name not in tensors:
            return np.full((batch, 1), default, dtype=np.int32)
        values = tensors[name].reshape(batch, -1)
        if values.shape[1] != 1:
            raise ValueError(
                f"{FIELD[name]} must hold one value per batch row, got {values.shape[1]}"
            )
        for value in values[:, 0]:
            if value < low:
                raise ValueError(f"{FIELD[name]} must be >= {low}, got {int(value)}")
            if name != "REQUEST_OUTPUT_LEN" and value >= self.vocab_size:
                raise ValueError(
                    f"{FIELD[name]} must be < vocab size {self.vocab_size}, got {int(value)}"
                )
        return values.astype(np.int32)

    def word_lists(self, tensors, name: str, batch: int) -> np.ndarray:
        rows = []
        for i in range(batch):
            words = []
            if name in tensors:
                words = parse_words(tensors[name][i].reshape(-1), FIELD[name])
            rows.append(encode_word_list(self.tokenizer, words))
        width = max(r.shape[1] for r in rows)
        out = np.zeros((batch, 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for i, r in enumerate(rows):
            out[i, :, : r.shape[1]] = r
        return out

    def bias(self, tensors, batch: int) -> np.ndarray:
        has_words, has_weights = (
            "EMBEDDING_BIAS_WORDS" in tensors,
            "EMBEDDING_BIAS_WEIGHTS" in tensors,
        )
        if not has_words and not has_weights:
            return np.zeros((batch, 0), dtype=np.float32)
        if has_words != has_weights:
            raise ValueError(
                "embedding_bias_words and embedding_bias_weights must be sent together"
            )
        out = np.zeros((batch, self.vocab_size), dtype=np.float32)
        for i in range(batch):
            words = [
                _text(w, "embedding_bias_words")
                for w in tensors["EMBEDDING_BIAS_WORDS"][i].reshape(-1)
            ]
            weights = tensors["EMBEDDING_BIAS_WEIGHTS"][i].reshape(-1)
            for token, value in embedding_bias(
                self.tokenizer, words, weights, self.vocab_size
            ).items():
                out[i, token] += value
        return out


def _text(value, field: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{field} must be valid UTF-8: {exc}") from None
    return str(value)

"""One choice of an OpenAI request -> the input tensors of one `tensorrt_llm` request.

OpenAI's temperature 0 is greedy whatever top_p says (tensorrt_llm would sample when top_p < 1),
so top_p and top_k are sent only when sampling. Stop strings also go to the engine as the token
sequences of the strings as given, so it stops at once where the output holds exactly those tokens
(it then drops them: the text ends where the stop string starts); generation.py cuts the text at a
stop string tokenized differently inside the output. Unlike the ensemble's `stop_words`, no
variant with a leading space is added: OpenAI's `stop` keeps the text before the string, space
included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import InferInput
from tritonclient.utils import np_to_triton_dtype

from ensemble.openai_server.errors import bad_request
from ensemble.openai_server.protocol import SamplingFields
from ensemble.openai_server.served_model import ServedModel
from preprocessing.tokenizer import encode
from preprocessing.word_lists import word_list_array


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    max_tokens: int | None  # None: the repository's default_max_tokens
    end_id: int  # -1: ignore the end id
    pad_id: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_words: np.ndarray | None = None  # [2, N] ids + offsets
    embedding_bias: np.ndarray | None = None  # [vocab]
    log_probs: bool = False
    top_log_probs: int = 0
    prompt_log_probs: bool = False

    def inputs(self) -> list[InferInput]:
        tensors = {
            "input_ids": np.array([self.prompt_ids], np.int32),
            "input_lengths": _scalar(len(self.prompt_ids), np.int32),
            "end_id": _scalar(self.end_id, np.int32),
            "pad_id": _scalar(self.pad_id, np.int32),
            "streaming": _scalar(True, np.bool_),
            "exclude_input_in_output": _scalar(True, np.bool_),
            "temperature": _scalar(self.temperature, np.float32),
        }
        if self.max_tokens is not None:
            tensors["request_output_len"] = _scalar(self.max_tokens, np.int32)
        if self.temperature > 0:
            tensors["runtime_top_p"] = _scalar(self.top_p, np.float32)
            tensors["runtime_top_k"] = _scalar(self.top_k, np.int32)
        if self.seed is not None:
            tensors["seed"] = _scalar(self.seed, np.uint64)
        for name, value, neutral in (
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ):
            if value != neutral:
                tensors[name] = _scalar(value, np.float32)
        if self.min_tokens:
            tensors["min_tokens"] = _scalar(self.min_tokens, np.int32)
        if self.stop_words is not None and self.stop_words.shape[1]:
            tensors["stop_words_list"] = self.stop_words[None].astype(np.int32)
        if self.embedding_bias is not None:
            tensors["embedding_bias"] = self.embedding_bias[None].astype(np.float32)
        if self.log_probs:
            tensors["return_log_probs"] = _scalar(True, np.bool_)
        if self.top_log_probs:  # the contract of the engine's top log-probs (branch logprobs)
            tensors["num_top_log_probs"] = _scalar(self.top_log_probs, np.int32)
        if self.prompt_log_probs:
            tensors["return_prompt_log_probs"] = _scalar(True, np.bool_)
        return [_infer_input(name, value) for name, value in tensors.items()]


def engine_request(
    body: SamplingFields,
    model: ServedModel,
    prompt_ids: list[int],
    max_tokens: int | None,
    choice: int,
    top_log_probs: int | None = None,
    prompt_log_probs: bool = False,
    ignore_end_id: bool = False,
) -> EngineRequest:
    """Choice `choice` of `body` (n > 1: seed + choice when a seed is given)."""
    greedy = body.temperature == 0 or body.top_p == 0
    return EngineRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        end_id=-1 if body.ignore_eos or ignore_end_id else model.end_id,
        pad_id=model.pad_id,
        temperature=0.0 if greedy else body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=None if body.seed is None else body.seed + choice,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        stop_words=stop_words(body, model),
        embedding_bias=logit_bias(body, model),
        log_probs=top_log_probs is not None or prompt_log_probs,
        top_log_probs=top_log_probs or 0,
        prompt_log_probs=prompt_log_probs,
    )


def stop_words(body: SamplingFields, model: ServedModel) -> np.ndarray | None:
    """Stop strings and stop_token_ids as one [2, N] word list (None when there are none)."""
    for token in body.stop_token_ids:
        check_token(token, model, "stop_token_ids")
    words = []
    for text in body.stop_strings():
        ids = encode(model.tokenizer, text, add_special_tokens=False)
        if ids and ids not in words:
            words.append(ids)
    words += [[token] for token in body.stop_token_ids if [token] not in words]
    return word_list_array(words) if words else None


def logit_bias(body: SamplingFields, model: ServedModel) -> np.ndarray | None:
    if not body.logit_bias:
        return None
    bias = np.zeros(model.vocab_size, np.float32)
    for key, value in body.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        check_token(token, model, "logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {value}", "logit_bias"
            )
        bias[token] = value
    return bias


def check_token(token: int, model: ServedModel, param: str) -> None:
    if not 0 <= token < model.vocab_size:
        raise bad_request(
            f"{param}: token id {token} is outside the vocabulary [0, {model.vocab_size})", param
        )


def _scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def _infer_input(name: str, value: np.ndarray) -> InferInput:
    tensor = InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    tensor.set_data_from_numpy(value)
    return tensor

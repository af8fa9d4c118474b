"""Input tensors of one `tensorrt_llm` request -> one engine request per batch row.

Works on plain numpy arrays (name -> array, batch dimension first) so it runs without Triton.
Every rejection is a ValueError naming the input and the rule.

Sampling mapping (TensorRT-LLM conventions): a request is greedy unless temperature > 0, or
runtime_top_k > 1, or 0 < runtime_top_p < 1; when sampling is asked through top_k/top_p alone,
temperature defaults to 1.0. runtime_top_p <= 0 means unset. len_penalty only affects beam search,
so it is accepted and has no effect at beam_width 1. end_id -1 means "no end id".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backend.sampling_params import SamplingParams
from ensemble.settings import ServeSettings
from ensemble.tensors import TENSORRT_LLM, ensemble_names
from preprocessing.word_lists import decode_word_list


def _scalars(dtype: str) -> tuple[str, ...]:
    return tuple(t.name for t in TENSORRT_LLM.inputs if t.dtype == dtype and t.dims == (1,))


INT_INPUTS = _scalars("INT32")
FLOAT_INPUTS = _scalars("FP32")
BOOL_INPUTS = _scalars("BOOL")
SEED_INPUTS = _scalars("UINT64")
# tensorrt_llm input -> the ensemble input it comes from, for error messages users recognise
ENSEMBLE_NAME = {llm: name for llm, name in ensemble_names("tensorrt_llm").items() if llm != name}
_SERVE = ServeSettings()  # the repository's defaults


def label(name: str) -> str:
    """`top_p (runtime_top_p)` for inputs whose ensemble name differs, else the name itself."""
    return f"{ENSEMBLE_NAME[name]} (input {name})" if name in ENSEMBLE_NAME else name


@dataclass
class RowRequest:
    """One engine request (one batch row of a Triton request) and how to answer it."""

    batch_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    streaming: bool
    exclude_input_in_output: bool
    return_perf_metrics: bool


@dataclass
class Defaults:
    max_tokens: int = _SERVE.default_max_tokens
    exclude_input_in_output: bool = _SERVE.exclude_input_in_output
    decoupled: bool = _SERVE.decoupled_mode  # the model's transaction policy: streaming needs it


def batch_size(tensors: dict[str, np.ndarray]) -> int:
    sizes = {name: arr.shape[0] for name, arr in tensors.items() if arr.ndim > 0}
    if not sizes:
        raise ValueError("input_ids is required")
    size = sizes.get("input_ids", next(iter(sizes.values())))
    for name, n in sizes.items():
        if n != size:
            raise ValueError(f"{name} has batch size {n}, but input_ids has {size}")
    return size


def is_stop_request(tensors: dict[str, np.ndarray]) -> bool:
    stop = tensors.get("stop")
    return stop is not None and stop.size > 0 and bool(np.asarray(stop).reshape(-1)[0])


def convert_request(
    tensors: dict[str, np.ndarray], defaults: Defaults, vocab_size: int | None = None
) -> list[RowRequest]:
    if "input_ids" not in tensors:
        raise ValueError("input_ids is required")
    rows = []
    for i in range(batch_size(tensors)):
        rows.append(
            convert_row({name: arr[i] for name, arr in tensors.items()}, i, defaults, vocab_size)
        )
    return rows


def convert_row(
    row: dict[str, np.ndarray], index: int, defaults: Defaults, vocab_size: int | None
) -> RowRequest:
    ints = {name: _scalar(row, name, int) for name in INT_INPUTS}
    floats = {name: _scalar(row, name, float) for name in FLOAT_INPUTS}
    bools = {name: _scalar(row, name, bool) for name in BOOL_INPUTS}
    seeds = {name: _scalar(row, name, int) for name in SEED_INPUTS}

    for name in ("beam_width", "num_return_sequences"):
        if ints[name] is not None and ints[name] != 1:
            raise ValueError(
                f"{name} must be 1 (beam search and multiple sequences are not "
                f"supported), got {ints[name]}"
            )
    for name in ("return_context_logits", "return_generation_logits"):
        if bools[name]:
            raise ValueError(f"{name} is not supported; send false or leave it out")
    if bools["streaming"] and not defaults.decoupled:
        raise ValueError(
            f"{label('streaming')} must be false: this model is not decoupled "
            "(decoupled_mode=false) and answers each request with one response; "
            "stream from a server built with decoupled_mode=true"
        )

    prompt = _prompt(row, ints["input_lengths"])
    max_tokens = ints["request_output_len"]
    if max_tokens is None:
        max_tokens = defaults.max_tokens
    elif max_tokens < 1:
        raise ValueError(f"{label('request_output_len')} must be >= 1, got {max_tokens}")

    temperature, top_k, top_p = (
        floats["temperature"],
        ints["runtime_top_k"],
        floats["runtime_top_p"],
    )
    if top_k is not None and top_k < 0:
        raise ValueError(f"{label('runtime_top_k')} must be >= 0, got {top_k}")
    if top_p is not None and top_p == 0:
        top_p = None
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"{label('runtime_top_p')} must be in (0, 1], got {top_p}")
    if temperature is not None and not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    sampled = (temperature or 0) > 0 or (top_k or 0) > 1 or (top_p is not None and top_p < 1)
    if sampled and not (temperature or 0) > 0:
        temperature = 1.0

    end_id = ints["end_id"]
    if end_id is not None and end_id < -1:
        raise ValueError(f"end_id must be a token id or -1, got {end_id}")
    if end_id is not None and vocab_size is not None and end_id >= vocab_size:
        raise ValueError(f"end_id must be < vocab size {vocab_size}, got {end_id}")
    min_tokens = ints["min_tokens"] if ints["min_tokens"] is not None else ints["min_length"]
    seed = seeds["seed"] if seeds["seed"] is not None else seeds["random_seed"]
    if floats["len_penalty"] is not None and not np.isfinite(floats["len_penalty"]):
        raise ValueError(f"{label('len_penalty')} must be finite, got {floats['len_penalty']}")

    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature) if sampled else 0.0,
        top_k=int(top_k or 0) if sampled else 0,
        top_p=float(top_p) if (sampled and top_p is not None) else 1.0,
        seed=seed,
        repetition_penalty=_or(floats["repetition_penalty"], 1.0),
        presence_penalty=_or(floats["presence_penalty"], 0.0),
        frequency_penalty=_or(floats["frequency_penalty"], 0.0),
        min_tokens=_or(min_tokens, 0),
        end_id=None if end_id in (None, -1) else end_id,
        ignore_end_id=end_id == -1,
        stop_token_ids=_words(row, "stop_words_list"),
        bad_token_ids=_words(row, "bad_words_list"),
        embedding_bias=_embedding_bias(row, vocab_size),
        return_log_probs=bool(bools["return_log_probs"]),
        num_top_log_probs=_or(ints["num_top_log_probs"], 0),
        return_prompt_log_probs=bool(bools["return_prompt_log_probs"]),
    )
    sampling.validate(vocab_size)
    exclude = bools["exclude_input_in_output"]
    return RowRequest(
        batch_index=index,
        prompt_ids=prompt,
        sampling=sampling,
        streaming=bool(bools["streaming"]),
        exclude_input_in_output=defaults.exclude_input_in_output if exclude is None else exclude,
        return_perf_metrics=bool(bools["return_perf_metrics"]),
    )


# ---- helpers -------------------------------------------------------------------------------------
def _or(value, default):
    return default if value is None else value


def _scalar(row: dict[str, np.ndarray], name: str, kind: type):
    """A per-row scalar input: shape [] or [1] after the batch dimension; None when absent."""
    if name not in row:
        return None
    arr = np.asarray(row[name])
    if arr.size != 1:
        raise ValueError(
            f"{label(name)} must hold exactly one value per batch row, got shape {list(arr.shape)}"
        )
    value = arr.reshape(-1)[0]
    if kind is bool:
        if arr.dtype != np.bool_:
            raise ValueError(f"{label(name)} must be BOOL, got {arr.dtype}")
        return bool(value)
    if kind is int:
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{label(name)} must be an integer tensor, got {arr.dtype}")
        return int(value)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{label(name)} must be a floating-point tensor, got {arr.dtype}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{label(name)} must be finite, got {value}")
    return value


def _prompt(row: dict[str, np.ndarray], length: int | None) -> list[int]:
    ids = np.asarray(row["input_ids"])
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be an integer tensor, got {ids.dtype}")
    ids = ids.reshape(-1)
    if length is not None:
        if not 0 <= length <= ids.size:
            raise ValueError(
                f"input_lengths must be in [0, {ids.size}] (the number of input_ids), got {length}"
            )
        ids = ids[:length]
    if ids.size == 0:
        raise ValueError("input_ids must not be empty")
    return [int(t) for t in ids]


def _words(row: dict[str, np.ndarray], name: str) -> list[list[int]]:
    if name not in row:
        return []
    arr = np.asarray(row[name])
    if arr.ndim == 3 and arr.shape[0] == 1:  # [1, 2, N] from a client without batching
        arr = arr[0]
    return decode_word_list(arr, name)


def _embedding_bias(row: dict[str, np.ndarray], vocab_size: int | None) -> dict[int, float]:
    if "embedding_bias" not in row:
        return {}
    bias = np.asarray(row["embedding_bias"], dtype=np.float64).reshape(-1)
    if bias.size == 0:
        return {}
    if vocab_size is not None and bias.size > vocab_size:
        raise ValueError(
            f"embedding_bias must have at most vocab size ({vocab_size}) entries, got {bias.size}"
        )
    if not np.all(np.isfinite(bias)):
        raise ValueError("embedding_bias must be finite")
    nonzero = np.nonzero(bias)[0]
    return {int(i): float(bias[i]) for i in nonzero}

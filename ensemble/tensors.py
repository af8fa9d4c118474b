"""The tensor interface of the five models (names, types and shapes as in tensorrtllm_backend).

Shapes exclude the batch dimension (every model has max_batch_size > 0). The ensemble's steps are
declared here too, so that `render.py` writes them and `wiring.py` checks them from one source.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str                    # Triton type without the TYPE_ prefix: INT32, FP32, BOOL, STRING...
    dims: tuple[int, ...] = (1,)
    optional: bool = False
    ragged: bool = False          # allow_ragged_batch (variable-length inputs)


@dataclass(frozen=True)
class Step:
    model: str
    inputs: dict[str, str]        # model input -> ensemble tensor
    outputs: dict[str, str]       # model output -> ensemble tensor


@dataclass(frozen=True)
class ModelIO:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    steps: tuple[Step, ...] = field(default=())


def _opt(name: str, dtype: str, dims: tuple[int, ...] = (1,), ragged: bool = False) -> Tensor:
    return Tensor(name, dtype, dims, optional=True, ragged=ragged)


# ---- per-response outputs shared by tensorrt_llm, the ensemble and the BLS model ------------------
PERF_OUTPUTS = (
    Tensor("kv_cache_alloc_new_blocks", "INT32"),
    Tensor("kv_cache_reused_blocks", "INT32"),
    Tensor("kv_cache_alloc_total_blocks", "INT32"),
    Tensor("arrival_time_ns", "INT64"),
    Tensor("first_scheduled_time_ns", "INT64"),
    Tensor("first_token_time_ns", "INT64"),
    Tensor("last_token_time_ns", "INT64"),
    Tensor("acceptance_rate", "FP32"),
    Tensor("total_accepted_draft_tokens", "INT32"),
    Tensor("total_draft_tokens", "INT32"),
)
LLM_SIDE_OUTPUTS = (
    Tensor("cum_log_probs", "FP32", (-1,)),
    Tensor("output_log_probs", "FP32", (-1, -1)),
    Tensor("batch_index", "INT32"),
    Tensor("sequence_index", "INT32"),
    # why the row ended (backend FinishReason: length, stop, end_id, cancelled); "" until then
    Tensor("finish_reason", "STRING"),
) + PERF_OUTPUTS

# ---- ensemble / BLS (text in, text out) ----------------------------------------------------------
# text_input is required, but declared optional and checked by preprocessing: Triton 2.51 answers
# a decoupled ensemble request that lacks a required input with an empty response, no error.
TEXT_INPUTS = (
    _opt("text_input", "STRING"),
    _opt("max_tokens", "INT32"),
    _opt("num_return_sequences", "INT32"),
    _opt("bad_words", "STRING", (-1,)),
    _opt("stop_words", "STRING", (-1,)),
    _opt("exclude_input_in_output", "BOOL"),
    _opt("end_id", "INT32"),
    _opt("pad_id", "INT32"),
    _opt("top_k", "INT32"),
    _opt("top_p", "FP32"),
    _opt("temperature", "FP32"),
    _opt("length_penalty", "FP32"),
    _opt("repetition_penalty", "FP32"),
    _opt("min_tokens", "INT32"),
    _opt("min_length", "INT32"),
    _opt("presence_penalty", "FP32"),
    _opt("frequency_penalty", "FP32"),
    _opt("seed", "UINT64"),
    _opt("random_seed", "UINT64"),
    _opt("return_log_probs", "BOOL"),
    _opt("return_context_logits", "BOOL"),
    _opt("return_generation_logits", "BOOL"),
    _opt("return_perf_metrics", "BOOL"),
    _opt("beam_width", "INT32"),
    _opt("stream", "BOOL"),
    _opt("embedding_bias_words", "STRING", (-1,)),
    _opt("embedding_bias_weights", "FP32", (-1,)),
    _opt("apply_chat_template", "BOOL"),
)
TEXT_OUTPUTS = (Tensor("text_output", "STRING", (-1,)),) + LLM_SIDE_OUTPUTS

# ---- preprocessing -------------------------------------------------------------------------------
PREPROCESSING = ModelIO(
    inputs=(
        _opt("QUERY", "STRING"),
        _opt("REQUEST_OUTPUT_LEN", "INT32"),
        _opt("BAD_WORDS_DICT", "STRING", (-1,)),
        _opt("STOP_WORDS_DICT", "STRING", (-1,)),
        _opt("EMBEDDING_BIAS_WORDS", "STRING", (-1,)),
        _opt("EMBEDDING_BIAS_WEIGHTS", "FP32", (-1,)),
        _opt("END_ID", "INT32"),
        _opt("PAD_ID", "INT32"),
        _opt("APPLY_CHAT_TEMPLATE", "BOOL"),
    ),
    outputs=(
        Tensor("INPUT_ID", "INT32", (-1,)),
        Tensor("REQUEST_INPUT_LEN", "INT32"),
        Tensor("BAD_WORDS_IDS", "INT32", (2, -1)),
        Tensor("STOP_WORDS_IDS", "INT32", (2, -1)),
        Tensor("EMBEDDING_BIAS", "FP32", (-1,)),
        Tensor("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
        Tensor("OUT_END_ID", "INT32"),
        Tensor("OUT_PAD_ID", "INT32"),
    ),
)

# ---- tensorrt_llm (token ids in, token ids out; decoupled unless decoupled_mode=false) --------
# The detok_* outputs carry the stateless incremental-detokenization window (see
# postprocessing/detokenizer.py): ids[window_start:], how many of them were already shown, final.
# llm_request_id names the engine request, so that the postprocessing step, which learns of a
# cancelled ensemble request (Triton 2.51 does not cancel the running LLM step), can stop it.
DETOK_OUTPUTS = (
    Tensor("detok_window_ids", "INT32", (-1, -1)),
    Tensor("detok_window_length", "INT32", (-1,)),
    Tensor("detok_context_length", "INT32"),
    Tensor("detok_final", "BOOL"),
    Tensor("llm_request_id", "STRING"),
)
TENSORRT_LLM = ModelIO(
    inputs=(
        _opt("input_ids", "INT32", (-1,), ragged=True),
        _opt("input_lengths", "INT32"),
        _opt("request_output_len", "INT32"),
        _opt("end_id", "INT32"),
        _opt("pad_id", "INT32"),
        _opt("stop_words_list", "INT32", (2, -1), ragged=True),
        _opt("bad_words_list", "INT32", (2, -1), ragged=True),
        _opt("embedding_bias", "FP32", (-1,), ragged=True),
        _opt("beam_width", "INT32"),
        _opt("temperature", "FP32"),
        _opt("runtime_top_k", "INT32"),
        _opt("runtime_top_p", "FP32"),
        _opt("len_penalty", "FP32"),
        _opt("repetition_penalty", "FP32"),
        _opt("presence_penalty", "FP32"),
        _opt("frequency_penalty", "FP32"),
        _opt("min_tokens", "INT32"),
        _opt("min_length", "INT32"),
        _opt("seed", "UINT64"),
        _opt("random_seed", "UINT64"),
        _opt("return_log_probs", "BOOL"),
        _opt("return_context_logits", "BOOL"),
        _opt("return_generation_logits", "BOOL"),
        _opt("return_perf_metrics", "BOOL"),
        _opt("exclude_input_in_output", "BOOL"),
        _opt("streaming", "BOOL"),
        _opt("stop", "BOOL"),
        _opt("num_return_sequences", "INT32"),
    ),
    outputs=(
        Tensor("output_ids", "INT32", (-1, -1)),
        Tensor("sequence_length", "INT32", (-1,)),
    ) + LLM_SIDE_OUTPUTS + DETOK_OUTPUTS,
)

# ---- postprocessing ------------------------------------------------------------------------------
POSTPROCESSING = ModelIO(
    inputs=(
        Tensor("TOKENS_BATCH", "INT32", (-1, -1), ragged=True),   # windows of any length, batched
        Tensor("SEQUENCE_LENGTH", "INT32", (-1,)),
        _opt("WINDOW_CONTEXT_LENGTH", "INT32"),
        _opt("IS_FINAL", "BOOL"),
        _opt("LLM_REQUEST_ID", "STRING"),
    ),
    outputs=(Tensor("OUTPUT", "STRING", (-1,)),),
)

# ---- ensemble ------------------------------------------------------------------------------------
_PRE_FROM_ENSEMBLE = {
    "QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
    "STOP_WORDS_DICT": "stop_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
    "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights", "END_ID": "end_id", "PAD_ID": "pad_id",
    "APPLY_CHAT_TEMPLATE": "apply_chat_template",
}
_PRE_TO_LLM = {  # preprocessing output -> (internal tensor, tensorrt_llm input)
    "INPUT_ID": ("_INPUT_ID", "input_ids"),
    "REQUEST_INPUT_LEN": ("_REQUEST_INPUT_LEN", "input_lengths"),
    "REQUEST_OUTPUT_LEN": ("_REQUEST_OUTPUT_LEN", "request_output_len"),
    "BAD_WORDS_IDS": ("_BAD_WORDS_IDS", "bad_words_list"),
    "STOP_WORDS_IDS": ("_STOP_WORDS_IDS", "stop_words_list"),
    "EMBEDDING_BIAS": ("_EMBEDDING_BIAS", "embedding_bias"),
    "OUT_END_ID": ("_PREPROCESSOR_END_ID", "end_id"),
    "OUT_PAD_ID": ("_PREPROCESSOR_PAD_ID", "pad_id"),
}
_LLM_FROM_ENSEMBLE = {  # tensorrt_llm input -> ensemble input
    "runtime_top_k": "top_k", "runtime_top_p": "top_p", "temperature": "temperature",
    "len_penalty": "length_penalty", "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "min_tokens": "min_tokens", "min_length": "min_length", "seed": "seed",
    "random_seed": "random_seed", "return_log_probs": "return_log_probs",
    "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits",
    "return_perf_metrics": "return_perf_metrics", "beam_width": "beam_width",
    "streaming": "stream", "exclude_input_in_output": "exclude_input_in_output",
    "num_return_sequences": "num_return_sequences",
}
_LLM_TO_POST = {  # tensorrt_llm output -> (internal tensor, postprocessing input)
    "detok_window_ids": ("_DETOK_WINDOW_IDS", "TOKENS_BATCH"),
    "detok_window_length": ("_DETOK_WINDOW_LENGTH", "SEQUENCE_LENGTH"),
    "detok_context_length": ("_DETOK_CONTEXT_LENGTH", "WINDOW_CONTEXT_LENGTH"),
    "detok_final": ("_DETOK_FINAL", "IS_FINAL"),
    "llm_request_id": ("_LLM_REQUEST_ID", "LLM_REQUEST_ID"),
}

ENSEMBLE = ModelIO(
    inputs=TEXT_INPUTS,
    outputs=TEXT_OUTPUTS,
    steps=(
        Step("preprocessing", dict(_PRE_FROM_ENSEMBLE),
             {out: internal for out, (internal, _) in _PRE_TO_LLM.items()}),
        Step("tensorrt_llm",
             {**{inp: internal for internal, inp in _PRE_TO_LLM.values()}, **_LLM_FROM_ENSEMBLE},
             {**{t.name: t.name for t in LLM_SIDE_OUTPUTS},
              **{out: internal for out, (internal, _) in _LLM_TO_POST.items()}}),
        Step("postprocessing", {inp: internal for internal, inp in _LLM_TO_POST.values()},
             {"OUTPUT": "text_output"}),
    ),
)

BLS = ModelIO(inputs=TEXT_INPUTS, outputs=TEXT_OUTPUTS)

MODELS = {
    "preprocessing": PREPROCESSING,
    "tensorrt_llm": TENSORRT_LLM,
    "postprocessing": POSTPROCESSING,
}

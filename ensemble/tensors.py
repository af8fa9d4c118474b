"""The tensor interface of the five models (names, types and shapes as in tensorrtllm_backend).

Shapes exclude the batch dimension (every model has max_batch_size > 0). The ensemble's steps are
declared here too, so that `render.py` writes them and `wiring.py` checks them from one source.
The values a client sends are one table (REQUEST_INPUTS: each one's name in every model that takes
it, and its type); the models' inputs, the ensemble's routing and the adapters' names for errors
and per-type readers are derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton type without the TYPE_ prefix: INT32, FP32, BOOL, STRING...
    dims: tuple[int, ...] = (1,)
    optional: bool = False
    ragged: bool = False  # allow_ragged_batch (variable-length inputs)


@dataclass(frozen=True)
class Step:
    model: str
    inputs: dict[str, str]  # model input -> ensemble tensor
    outputs: dict[str, str]  # model output -> ensemble tensor


@dataclass(frozen=True)
class ModelIO:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    steps: tuple[Step, ...] = field(default=())


def _opt(name: str, dtype: str, dims: tuple[int, ...] = (1,), ragged: bool = False) -> Tensor:
    return Tensor(name, dtype, dims, optional=True, ragged=ragged)


# ---- per-response outputs shared by tensorrt_llm, the ensemble and the BLS model -----------------
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


# ---- request inputs: one row per value a client sends, with its name in each model --------------
@dataclass(frozen=True)
class RequestInput:
    """Its name at `ensemble` and `tensorrt_llm_bls`, at `tensorrt_llm` (same type) and at
    `preprocessing` (None: not an input there). Where both name it, preprocessing reads it and
    hands it on to tensorrt_llm; otherwise the ensemble sends it straight to tensorrt_llm."""

    ensemble: str
    llm: str | None
    preprocessing: str | None
    dtype: str
    dims: tuple[int, ...] = (1,)


# text_input is required, but declared optional and checked by preprocessing: Triton 2.51 answers
# a decoupled ensemble request that lacks a required input with an empty response, no error.
_ROWS = (  # ensemble input, tensorrt_llm input, preprocessing input, type[, dims]
    ("text_input", None, "QUERY", "STRING"),
    ("max_tokens", "request_output_len", "REQUEST_OUTPUT_LEN", "INT32"),
    ("num_return_sequences", "num_return_sequences", None, "INT32"),
    ("bad_words", None, "BAD_WORDS_DICT", "STRING", (-1,)),
    ("stop_words", None, "STOP_WORDS_DICT", "STRING", (-1,)),
    ("exclude_input_in_output", "exclude_input_in_output", None, "BOOL"),
    ("end_id", "end_id", "END_ID", "INT32"),
    ("pad_id", "pad_id", "PAD_ID", "INT32"),
    ("top_k", "runtime_top_k", None, "INT32"),
    ("top_p", "runtime_top_p", None, "FP32"),
    ("temperature", "temperature", None, "FP32"),
    ("length_penalty", "len_penalty", None, "FP32"),
    ("repetition_penalty", "repetition_penalty", None, "FP32"),
    ("min_tokens", "min_tokens", None, "INT32"),
    ("min_length", "min_length", None, "INT32"),
    ("presence_penalty", "presence_penalty", None, "FP32"),
    ("frequency_penalty", "frequency_penalty", None, "FP32"),
    ("seed", "seed", None, "UINT64"),
    ("random_seed", "random_seed", None, "UINT64"),
    ("return_log_probs", "return_log_probs", None, "BOOL"),
    ("return_context_logits", "return_context_logits", None, "BOOL"),
    ("return_generation_logits", "return_generation_logits", None, "BOOL"),
    ("return_perf_metrics", "return_perf_metrics", None, "BOOL"),
    ("beam_width", "beam_width", None, "INT32"),
    ("stream", "streaming", None, "BOOL"),
    ("embedding_bias_words", None, "EMBEDDING_BIAS_WORDS", "STRING", (-1,)),
    ("embedding_bias_weights", None, "EMBEDDING_BIAS_WEIGHTS", "FP32", (-1,)),
    ("apply_chat_template", None, "APPLY_CHAT_TEMPLATE", "BOOL"),
)
REQUEST_INPUTS = tuple(RequestInput(*row) for row in _ROWS)


def ensemble_names(model: str) -> dict[str, str]:
    """{input of `model` ("preprocessing" or "tensorrt_llm"): the ensemble input it carries}."""
    column = {"preprocessing": "preprocessing", "tensorrt_llm": "llm"}[model]
    return {getattr(r, column): r.ensemble for r in REQUEST_INPUTS if getattr(r, column)}


def _inputs(column: str) -> tuple[Tensor, ...]:
    return tuple(
        _opt(getattr(r, column), r.dtype, r.dims) for r in REQUEST_INPUTS if getattr(r, column)
    )


# ---- ensemble / BLS (text in, text out) ----------------------------------------------------------
TEXT_INPUTS = _inputs("ensemble")
TEXT_OUTPUTS = (Tensor("text_output", "STRING", (-1,)),) + LLM_SIDE_OUTPUTS

# ---- preprocessing -------------------------------------------------------------------------------
PREPROCESSING = ModelIO(
    inputs=_inputs("preprocessing"),
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
# Ours, not tensorrtllm_backend's: top-k and prompt log-probs for clients of tensorrt_llm itself
# (an OpenAI-style front end). Sent only when asked; the ensemble and BLS do not carry them.
TOP_LOGPROB_INPUTS = (
    _opt("num_top_log_probs", "INT32"),
    _opt("return_prompt_log_probs", "BOOL"),
)
TOP_LOGPROB_OUTPUTS = (
    Tensor("top_log_probs", "FP32", (-1, -1, -1)),
    Tensor("top_token_ids", "INT32", (-1, -1, -1)),
    Tensor("prompt_log_probs", "FP32", (-1, -1)),
    Tensor("prompt_top_log_probs", "FP32", (-1, -1, -1)),
    Tensor("prompt_top_token_ids", "INT32", (-1, -1, -1)),
)
TENSORRT_LLM = ModelIO(
    inputs=(
        _opt("input_ids", "INT32", (-1,), ragged=True),
        _opt("input_lengths", "INT32"),
        _opt("stop_words_list", "INT32", (2, -1), ragged=True),
        _opt("bad_words_list", "INT32", (2, -1), ragged=True),
        _opt("embedding_bias", "FP32", (-1,), ragged=True),
    )
    + _inputs("llm")
    + (_opt("stop", "BOOL"),)
    + TOP_LOGPROB_INPUTS,
    outputs=(
        Tensor("output_ids", "INT32", (-1, -1)),
        Tensor("sequence_length", "INT32", (-1,)),
    )
    + LLM_SIDE_OUTPUTS
    + DETOK_OUTPUTS
    + TOP_LOGPROB_OUTPUTS,
)

# ---- postprocessing ------------------------------------------------------------------------------
POSTPROCESSING = ModelIO(
    inputs=(
        Tensor("TOKENS_BATCH", "INT32", (-1, -1), ragged=True),  # windows of any length, batched
        Tensor("SEQUENCE_LENGTH", "INT32", (-1,)),
        _opt("WINDOW_CONTEXT_LENGTH", "INT32"),
        _opt("IS_FINAL", "BOOL"),
        _opt("LLM_REQUEST_ID", "STRING"),
    ),
    outputs=(Tensor("OUTPUT", "STRING", (-1,)),),
)

# ---- ensemble ------------------------------------------------------------------------------------
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
_LLM_FROM_ENSEMBLE = {  # tensorrt_llm input -> ensemble input, for those preprocessing doesn't read
    r.llm: r.ensemble for r in REQUEST_INPUTS if r.llm and not r.preprocessing
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
        Step(
            "preprocessing",
            ensemble_names("preprocessing"),
            {out: internal for out, (internal, _) in _PRE_TO_LLM.items()},
        ),
        Step(
            "tensorrt_llm",
            {**{inp: internal for internal, inp in _PRE_TO_LLM.values()}, **_LLM_FROM_ENSEMBLE},
            {
                **{t.name: t.name for t in LLM_SIDE_OUTPUTS},
                **{out: internal for out, (internal, _) in _LLM_TO_POST.items()},
            },
        ),
        Step(
            "postprocessing",
            {inp: internal for internal, inp in _LLM_TO_POST.values()},
            {"OUTPUT": "text_output"},
        ),
    ),
)

BLS = ModelIO(inputs=TEXT_INPUTS, outputs=TEXT_OUTPUTS)

MODELS = {
    "preprocessing": PREPROCESSING,
    "tensorrt_llm": TENSORRT_LLM,
    "postprocessing": POSTPROCESSING,
}

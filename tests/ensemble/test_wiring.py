"""Wiring checks: the shipped ensemble is sound, and each kind of mistake is reported."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ensemble.tensors import ENSEMBLE, MODELS, ModelIO, Step, Tensor
from ensemble.wiring import WiringError, check_wiring


def test_shipped_ensemble_is_sound():
    check_wiring(ENSEMBLE, MODELS)


def test_ensemble_declares_the_tensorrtllm_backend_interface():
    inputs = {t.name: t for t in ENSEMBLE.inputs}
    assert inputs["text_input"].dtype == "STRING"  # required: preprocessing rejects its absence
    assert inputs["max_tokens"].optional  # optional here, with a configured default
    for name in (
        "stream",
        "end_id",
        "pad_id",
        "top_k",
        "top_p",
        "temperature",
        "min_length",
        "min_tokens",
        "seed",
        "random_seed",
        "bad_words",
        "stop_words",
        "exclude_input_in_output",
        "return_log_probs",
        "beam_width",
        "num_return_sequences",
        "embedding_bias_words",
        "embedding_bias_weights",
        "return_perf_metrics",
        "length_penalty",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        assert inputs[name].optional, name
    outputs = {t.name for t in ENSEMBLE.outputs}
    assert {
        "text_output",
        "cum_log_probs",
        "output_log_probs",
        "batch_index",
        "sequence_index",
        "kv_cache_alloc_new_blocks",
        "kv_cache_reused_blocks",
        "kv_cache_alloc_total_blocks",
        "arrival_time_ns",
        "first_scheduled_time_ns",
        "first_token_time_ns",
        "last_token_time_ns",
    } <= outputs


def _with_step(index: int, step: Step) -> ModelIO:
    steps = list(ENSEMBLE.steps)
    steps[index] = step
    return replace(ENSEMBLE, steps=tuple(steps))


def test_unknown_source_tensor():
    post = ENSEMBLE.steps[2]
    broken = _with_step(2, replace(post, inputs={**post.inputs, "TOKENS_BATCH": "_NOPE"}))
    with pytest.raises(WiringError, match="'_NOPE', which is neither an ensemble input"):
        check_wiring(broken, MODELS)


def test_type_mismatch():
    llm = ENSEMBLE.steps[1]
    broken = _with_step(1, replace(llm, inputs={**llm.inputs, "runtime_top_p": "top_k"}))
    with pytest.raises(WiringError, match="type INT32 does not match FP32"):
        check_wiring(broken, MODELS)


def test_missing_required_input_and_unknown_names():
    post = ENSEMBLE.steps[2]
    inputs = {k: v for k, v in post.inputs.items() if k != "TOKENS_BATCH"}
    inputs["NOT_AN_INPUT"] = "_DETOK_FINAL"
    with pytest.raises(WiringError) as err:
        check_wiring(_with_step(2, replace(post, inputs=inputs)), MODELS)
    assert "required input 'TOKENS_BATCH' is not fed" in str(err.value)
    assert "'NOT_AN_INPUT' is not an input of the model" in str(err.value)


def test_output_not_produced():
    extra = replace(
        ENSEMBLE, outputs=ENSEMBLE.outputs + (Tensor("context_logits", "FP32", (-1, -1)),)
    )
    with pytest.raises(WiringError, match="ensemble output 'context_logits' is not produced"):
        check_wiring(extra, MODELS)


def test_step_after_decoupled_model_reading_the_request():
    post = ENSEMBLE.steps[2]
    broken = _with_step(2, replace(post, inputs={**post.inputs, "IS_FINAL": "stream"}))
    with pytest.raises(WiringError, match="after a decoupled step read only its outputs"):
        check_wiring(broken, MODELS)


def test_shape_mismatch():
    post = ENSEMBLE.steps[2]
    broken = _with_step(
        2, replace(post, inputs={**post.inputs, "TOKENS_BATCH": "_DETOK_WINDOW_LENGTH"})
    )
    with pytest.raises(WiringError, match="shape"):
        check_wiring(broken, MODELS)

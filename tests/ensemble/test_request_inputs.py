"""One table (ensemble/tensors.py REQUEST_INPUTS) names each request input in every model: the
models' declared inputs, the ensemble's wiring, the preprocessing adapter's error names (FIELD)
and the LLM adapter's per-dtype readers are all derived from it, and agree with it."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble.settings import ServeSettings
from ensemble.tensors import ENSEMBLE, PREPROCESSING, REQUEST_INPUTS, TENSORRT_LLM
from tests.adapters import initialize_args, load_adapter
from tests.tokenizer_fixtures import smollm2_tokenizer_dir

PRE, LLM, _ = ENSEMBLE.steps
llm_inputs = load_adapter("tensorrt_llm", "llm_inputs")
preprocessing = load_adapter("preprocessing")


def test_each_row_declares_its_input_in_each_model_with_its_type():
    declared = {
        model: {t.name: t.dtype for t in io.inputs}
        for model, io in (
            ("ensemble", ENSEMBLE),
            ("llm", TENSORRT_LLM),
            ("preprocessing", PREPROCESSING),
        )
    }
    for row in REQUEST_INPUTS:
        assert declared["ensemble"][row.ensemble] == row.dtype, row
        for column in ("llm", "preprocessing"):
            if getattr(row, column):
                assert declared[column][getattr(row, column)] == row.dtype, row
    assert [t.name for t in ENSEMBLE.inputs] == [r.ensemble for r in REQUEST_INPUTS]


def test_the_ensemble_routes_each_row_as_the_table_says():
    pre_outputs = set(PRE.outputs.values())
    for row in REQUEST_INPUTS:
        if row.preprocessing:
            assert PRE.inputs[row.preprocessing] == row.ensemble, row
        if row.llm and row.preprocessing:  # preprocessing hands it on
            assert LLM.inputs[row.llm] in pre_outputs, row
        elif row.llm:  # straight from the request
            assert LLM.inputs[row.llm] == row.ensemble, row
    read = set(PRE.inputs.values()) | set(LLM.inputs.values())
    assert {r.ensemble for r in REQUEST_INPUTS} <= read


def test_preprocessing_field_names_are_the_tables():
    assert preprocessing.FIELD == {
        r.preprocessing: r.ensemble for r in REQUEST_INPUTS if r.preprocessing
    }
    assert preprocessing.FIELD == PRE.inputs


def test_llm_dtype_lists_are_the_tables():
    lists = {
        "INT32": llm_inputs.INT_INPUTS,
        "FP32": llm_inputs.FLOAT_INPUTS,
        "BOOL": llm_inputs.BOOL_INPUTS,
        "UINT64": llm_inputs.SEED_INPUTS,
    }
    for row in REQUEST_INPUTS:
        if row.llm:
            assert row.llm in lists[row.dtype], row
    scalars = [t.name for t in TENSORRT_LLM.inputs if t.dims == (1,)]
    listed = [name for names in lists.values() for name in names]
    assert sorted(listed) == sorted(scalars)  # each scalar input read, and once
    assert llm_inputs.ENSEMBLE_NAME == {
        r.llm: r.ensemble for r in REQUEST_INPUTS if r.llm and r.llm != r.ensemble
    }


def test_llm_errors_name_the_ensemble_input():
    tensors = {
        "input_ids": np.array([[5, 6]], np.int32),
        "runtime_top_k": np.array([[-1]], np.int32),
    }
    with pytest.raises(ValueError, match=r"^top_k \(input runtime_top_k\) must be >= 0, got -1"):
        llm_inputs.convert_request(tensors, llm_inputs.Defaults(), 100)
    tensors = {
        "input_ids": np.array([[5, 6]], np.int32),
        "runtime_top_k": np.array([[1.0]], np.float32),
    }
    with pytest.raises(ValueError, match=r"^top_k \(input runtime_top_k\) must be an integer"):
        llm_inputs.convert_request(tensors, llm_inputs.Defaults(), 100)


@pytest.fixture(scope="module")
def preprocessor():
    model = preprocessing.TritonPythonModel()
    settings = ServeSettings(tokenizer_dir=smollm2_tokenizer_dir(), default_max_tokens=9)
    model.initialize(initialize_args("preprocessing", settings))
    yield model
    model.finalize()


def _query(**inputs) -> dict[str, np.ndarray]:
    tensors = {"QUERY": np.array([[b"Hello there"]], dtype=np.object_)}
    tensors.update({name: np.array([[value]], np.int32) for name, value in inputs.items()})
    return tensors


def test_preprocessing_hands_on_what_the_table_routes_through_it(preprocessor):
    out = preprocessor.convert(_query(REQUEST_OUTPUT_LEN=5, END_ID=2, PAD_ID=3))
    assert (
        out["REQUEST_OUTPUT_LEN"].tolist(),
        out["OUT_END_ID"].tolist(),
        out["OUT_PAD_ID"].tolist(),
    ) == ([[5]], [[2]], [[3]])
    defaults = preprocessor.convert(_query())
    assert defaults["REQUEST_OUTPUT_LEN"].tolist() == [[9]]  # the repository's default_max_tokens


@pytest.mark.parametrize(
    "inputs, message",
    [
        (dict(REQUEST_OUTPUT_LEN=0), "max_tokens must be >= 1, got 0"),
        (dict(END_ID=-2), "end_id must be >= -1, got -2"),
        (dict(PAD_ID=10**6), "pad_id must be < vocab size"),
    ],
)
def test_preprocessing_errors_name_the_ensemble_input(preprocessor, inputs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        preprocessor.convert(_query(**inputs))

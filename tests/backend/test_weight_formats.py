"""The weight-format table (backend/weight_formats.py) and the classes of its formats
(backend.quantization.WEIGHT_CLASSES) agree: every format but float has its class, a format
quantized at load or allowed for the lm_head has a quantizer, one read from checkpoints has a
layout, and the engine parameter takes exactly the table's names and "auto"."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.quantization import WEIGHT_CLASSES, QuantizedWeight
from backend.weight_formats import AUTO, FORMATS, QUANTIZATIONS, check_tensor_parallel


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name).__func__ is not getattr(QuantizedWeight, name).__func__


def test_every_format_but_float_has_its_class():
    assert set(WEIGHT_CLASSES) == set(FORMATS) - {"none"}
    assert all(cls.format == name for name, cls in WEIGHT_CLASSES.items())


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "none"])
def test_a_formats_class_does_what_its_row_says(name):
    row, cls = FORMATS[name], WEIGHT_CLASSES[name]
    if row.at_load or row.lm_head:
        assert _overrides(cls, "quantize")
    reads_checkpoints = row.declared_method is not None
    assert (cls.checkpoint is not None) == reads_checkpoints
    assert _overrides(cls, "checkpoint_buffers") == reads_checkpoints
    if reads_checkpoints:
        assert _overrides(cls, "for_checkpoint")


def test_the_engine_parameter_takes_the_tables_names():
    assert QUANTIZATIONS == (*FORMATS, AUTO)
    for name in QUANTIZATIONS:
        assert EngineConfig(quantization=name).quantization == name
    for name, row in FORMATS.items():
        if row.lm_head:
            EngineConfig(quantization=name, quantize_lm_head=True)
        else:
            with pytest.raises(ValueError, match=f"quantize_lm_head needs .* '{name}'"):
                EngineConfig(quantization=name, quantize_lm_head=True)
        if row.tensor_parallel:
            check_tensor_parallel(name, 2)
        else:
            with pytest.raises(ValueError, match=f"'{name}' is not supported with tensor_para"):
                check_tensor_parallel(name, 2)

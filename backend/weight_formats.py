"""The weight formats (the engine parameter `quantization`): one table, from which every list of
names and every refusal below derives, and the rules that pick a format for a checkpoint (its
config.json's `quantization_config`). No torch: the ensemble checks a setting with it before
anything starts. Each format's class (its quantizer, checkpoint layout and checks) is
`backend.quantization.WEIGHT_CLASSES[name]`.

Adding a format: its `QuantizedWeight` file, its kernel, a row here and its class in that map.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    name: str  # the `quantization` value
    # A checkpoint holding it declares quantization_config.quant_method so (None: none is read).
    declared_method: str | None
    at_load: bool  # float weights are quantized into it at load
    lm_head: bool  # `quantize_lm_head` may hold the lm_head in it
    tensor_parallel: bool  # its weights split across ranks (tensor_parallel_size > 1)


FORMATS = {
    f.name: f
    for f in (
        # float weights; a GGUF de-quantized once into a cached float32 copy
        WeightFormat("none", None, at_load=False, lm_head=False, tensor_parallel=True),
        # a GGUF file's blocks, kept as stored
        WeightFormat("gguf", None, at_load=False, lm_head=False, tensor_parallel=False),
        WeightFormat("int8_wo", None, at_load=True, lm_head=True, tensor_parallel=False),
        WeightFormat("int4_wo", None, at_load=True, lm_head=True, tensor_parallel=False),
        WeightFormat("int4_awq", "awq", at_load=False, lm_head=True, tensor_parallel=False),
        WeightFormat("int4_gptq", "gptq", at_load=False, lm_head=True, tensor_parallel=False),
        WeightFormat("fp8", "fp8", at_load=True, lm_head=True, tensor_parallel=False),
    )
}
AUTO = "auto"  # what the checkpoint declares (a .gguf file or the default model: gguf)
QUANTIZATIONS = (*FORMATS, AUTO)  # the values of the engine parameter
DECLARED = {f.declared_method: f.name for f in FORMATS.values() if f.declared_method}
AT_LOAD = tuple(f.name for f in FORMATS.values() if f.at_load)
FROM_CHECKPOINT = tuple(DECLARED.values())
LM_HEAD = tuple(f.name for f in FORMATS.values() if f.lm_head)
TENSOR_PARALLEL = tuple(f.name for f in FORMATS.values() if f.tensor_parallel)


def quoted(names) -> str:
    return ", ".join(map(repr, names))


# ---- refusals ------------------------------------------------------------------------------------
def check_lm_head(quantization: str, requested: str | None = None) -> None:
    """Raise ValueError unless `quantize_lm_head` can hold the lm_head in `quantization` (what
    the engine parameter `requested` resolved to, where the loader asks). A name not in the
    table passes: "auto" is checked once resolved, others are refused by the check of names."""
    if quantization not in FORMATS or FORMATS[quantization].lm_head:
        return
    requested = requested or quantization
    serves = f", which serves this model as {quantization!r}" if requested != quantization else ""
    raise ValueError(
        "quantize_lm_head needs a weight format quantized at load or from a checkpoint "
        f"({', '.join(LM_HEAD)}, {AUTO}), got quantization {requested!r}{serves}"
    )


def check_tensor_parallel(quantization: str, size: int) -> None:
    """Raise ValueError unless `quantization`'s weights split across `size` ranks ("auto"
    passes: checked again once resolved)."""
    if size > 1 and quantization in FORMATS and quantization not in TENSOR_PARALLEL:
        raise ValueError(
            f"quantization {quantization!r} is not supported with tensor_parallel_size > 1 "
            "(its blocks or scales are not split across ranks): use quantization "
            f"{quoted(TENSOR_PARALLEL)}"
        )


def check_exclude(exclude: tuple[str, ...], weights: str) -> None:
    """Raise ValueError for `quantization_exclude` fragments on weights not quantized at load."""
    if exclude:
        raise ValueError(
            "quantization_exclude applies to float weights quantized at load (quantization "
            f"{', '.join(AT_LOAD)} on a float checkpoint); these weights are {weights}"
        )


def needs_declaring_checkpoint(quantization: str, model: str) -> ValueError:
    """The refusal of a checkpoint format for a `model` that does not declare it ("<directory>
    holds float weights", "<name> is not a checkpoint directory")."""
    method = next((m for m, q in DECLARED.items() if q == quantization), quantization)
    return ValueError(
        f"quantization {quantization!r} needs a checkpoint whose config.json declares it "
        f"(quantization_config.quant_method {method!r}); {model}: use one of "
        f"{quoted(('none', AUTO, *AT_LOAD))}"
    )


# ---- a checkpoint's format -----------------------------------------------------------------------
def quantization_config(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("quantization_config")


def declared_quantization(model_dir: str) -> str:
    """The `quantization` value a directory's checkpoint declares: "none" for float weights."""
    config = quantization_config(model_dir)
    if config is None:
        return "none"
    method = config.get("quant_method")
    if method not in DECLARED:
        raise ValueError(
            f"quantization_config.quant_method must be one of {tuple(DECLARED)} in {model_dir}, "
            f"got {method!r}"
        )
    return DECLARED[method]


def pick_quantization(requested: str, model_dir: str) -> str:
    """The format to load `model_dir` in for the engine parameter `quantization` (not "gguf",
    which `backend.loading.model_paths.kept_gguf` handles): "auto" is what the checkpoint declares;
    a checkpoint format needs its checkpoint; formats quantized at load take a float checkpoint
    (fp8 also its own checkpoint). Raises ValueError naming the rule otherwise."""
    declared = declared_quantization(model_dir)
    if requested == AUTO or requested == declared:
        return declared
    if requested in AT_LOAD and declared == "none":
        return requested
    if declared == "none":
        raise needs_declaring_checkpoint(requested, f"{model_dir} holds float weights")
    raise ValueError(
        f"quantization {requested!r} does not match the checkpoint in {model_dir}, which "
        f"declares {declared!r}: use {AUTO!r} or {declared!r}"
    )

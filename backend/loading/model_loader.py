"""Load a model: a Hugging Face directory (see backend/loading/model_paths.py for names and files)
-> our model, with safetensors weights or random ones for a preset, or the blocks of a GGUF file
kept quantized (backend/loading/gguf_weights.py). A quantized checkpoint (AWQ, GPTQ, FP8) keeps its
format; int8_wo, int4_wo and fp8 quantize float weights once loaded (backend/quantization/).
The weights' resident size is logged."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable
from itertools import chain
from typing import Iterator

import torch

from backend.attention import AttentionBackend
from backend.distributed.tensor_parallel import TensorParallel
from backend.loading.presets import init_random_weights, random_weights_spec
from backend.loading.quantized_checkpoint import (
    FORMATS,
    load_quantized_weights,
    prepare_quantized,
    quantize_at_load,
    quantize_lm_head,
)
from backend.loading.weight_formats import pick_quantization, quantization_config
from backend.model_config import ModelConfig
from backend.models import FAMILIES
from backend.models.null import NullModel
from backend.quantization import QuantizedWeight
from backend.quantization.fp8 import use_fast_accumulation

log = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (other weight formats are not supported)"
        )
    return files


def safetensors_names(model_dir: str) -> set[str]:
    """The tensor names of model_dir's safetensors files (headers only)."""
    from safetensors import safe_open

    names = set()
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) from model_dir's safetensors files, one tensor at a time."""
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionBackend,
    max_positions: int,
    prepare: Callable[[torch.nn.Module], None] | None = None,
    tp: TensorParallel | None = None,
) -> torch.nn.Module:
    """An uninitialised model of the config's family, allocated directly on `device` in `dtype`
    (no host copy). `prepare(model)` may change it while it is on the meta device. With `tp`
    (more than one rank) the model is this rank's shard."""
    family = FAMILIES[config.model_type]
    shard = {}
    if tp is not None and tp.enabled:
        if not getattr(family, "supports_tensor_parallel", False):
            raise ValueError(
                f"tensor_parallel_size > 1 is not supported for model_type {config.model_type!r}"
            )
        shard = {"tp": tp}
    with torch.device("meta"):
        model = family(config, attention, max_positions, **shard).to(dtype=dtype)
        if prepare is not None:  # after the cast: quantized buffers keep their own dtypes
            prepare(model)
    model = model.to_empty(device=device)
    model.materialise_buffers(device)
    return model.eval()


def load_model(
    model_dir: str,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionBackend,
    max_positions: int,
    config: ModelConfig | None = None,
    gguf_file: str | None = None,
    quantization: str = "none",
    tp: TensorParallel | None = None,
    exclude: tuple[str, ...] = (),
    lm_head: bool = False,
    fp8_fast_accumulation: bool = False,
) -> torch.nn.Module:
    """Build the model for `model_dir` and fill it: safetensors weights, random ones for a preset,
    or, given `gguf_file`, that file's blocks kept quantized (the directory gives the config).
    `quantization` (the engine parameter, not "gguf"): see `pick_quantization`; `lm_head`
    (`quantize_lm_head`): the lm_head is quantized too; `fp8_fast_accumulation`: its fp8 weights
    sum without promoting (`backend.quantization.fp8.use_fast_accumulation`).
    With `tp`, this rank's shard: each full tensor is cut as it is read (a preset's random
    weights are drawn per shard, so they differ from one rank's); float weights only."""
    config = config or ModelConfig.from_dir(model_dir)
    if config.model_type == "null":
        return NullModel(config)
    if gguf_file is not None:
        _refuse_exclude(exclude, "kept GGUF blocks")
        _refuse_lm_head(lm_head, "gguf")
        if tp is not None and tp.enabled:
            # Row-parallel layers would cut GGUF blocks across their columns.
            raise ValueError(
                "quantization 'gguf' keeps GGUF blocks, which are not split across ranks: "
                "use quantization 'none' with tensor_parallel_size > 1"
            )
        return _load_gguf(gguf_file, config, device, dtype, attention, max_positions)
    quantization = pick_quantization(quantization, model_dir)
    if tp is not None and tp.enabled and quantization != "none":
        # Quantized weights keep per-group or per-block scales that a shard would have to cut.
        raise ValueError(
            f"quantization {quantization!r} is not supported with tensor_parallel_size > 1: "
            "use quantization 'none'"
        )
    if quantization in FORMATS and quantization_config(model_dir) is not None:
        _refuse_exclude(exclude, "quantized in the checkpoint")
        model = _load_quantized(
            model_dir, quantization, config, device, dtype, attention, max_positions
        )
        if lm_head:
            _quantize_lm_head(model, quantization)
        _prepare_quantized(model, dtype)
        _fast_accumulation(model, fp8_fast_accumulation)
        return model
    if quantization == "none":
        _refuse_exclude(exclude, "not quantized (quantization 'none')")
        _refuse_lm_head(lm_head, "none")
    model = build_model(config, device, dtype, attention, max_positions, tp=tp)
    spec = random_weights_spec(model_dir)
    with torch.no_grad():
        if spec is not None:
            init_random_weights(model, seed=spec.get("seed", 0), std=spec.get("std", 0.02))
        else:
            model.load_weights(iter_safetensors(model_dir))
        quantized = quantize_at_load(model, quantization, exclude) if quantization != "none" else 0
        if lm_head:
            _quantize_lm_head(model, quantization)
        _prepare_quantized(model, dtype)
    log.info(
        "weights: %s (%s%s)",
        _megabytes(weight_bytes(model)),
        str(dtype).split(".")[-1],
        f"; {quantization} x{quantized}, quantized at load" if quantized else "",
    )
    _fast_accumulation(model, fp8_fast_accumulation)
    return model


def _refuse_exclude(exclude: tuple[str, ...], weights: str) -> None:
    if exclude:
        raise ValueError(
            "quantization_exclude applies to float weights quantized at load (quantization "
            f"int8_wo, int4_wo or fp8 on a float checkpoint); these weights are {weights}"
        )


def _refuse_lm_head(lm_head: bool, quantization: str) -> None:
    if lm_head:
        raise ValueError(
            "quantize_lm_head needs a weight format quantized at load or from a checkpoint "
            f"(int8_wo, int4_wo, int4_awq, int4_gptq, fp8); these weights are {quantization!r}"
        )


def _prepare_quantized(model: torch.nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            module.prepare_for(dtype)


def _fast_accumulation(model: torch.nn.Module, wanted: bool) -> None:
    if wanted:
        log.info("fp8_fast_accumulation: %d fp8 weights", use_fast_accumulation(model))


def _quantize_lm_head(model: torch.nn.Module, quantization: str) -> None:
    with torch.no_grad():
        quantize_lm_head(model, quantization)
    log.info("lm_head: %s (quantize_lm_head)", model.lm_head.quantized)


def _load_quantized(model_dir, quantization, config, device, dtype, attention, max_positions):
    from backend.models.hf_weights import weight_targets

    qconfig = quantization_config(model_dir)
    names = safetensors_names(model_dir)
    targets, count = {}, []

    def prepare(model: torch.nn.Module) -> None:
        targets.update(weight_targets(model))
        count.append(prepare_quantized(model, quantization, qconfig, names, targets))

    model = build_model(config, device, dtype, attention, max_positions, prepare)
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    with torch.no_grad():
        load_quantized_weights(
            model, iter_safetensors(model_dir), quantization, qconfig, targets, ignored=tied
        )
    log.info(
        "weights: %s (%s x%d from the checkpoint; the rest %s)",
        _megabytes(weight_bytes(model)),
        quantization,
        count[0],
        str(dtype).split(".")[-1],
    )
    return model


def _load_gguf(gguf_file, config, device, dtype, attention, max_positions) -> torch.nn.Module:
    from backend.loading.gguf_weights import read_gguf

    model, kept = load_gguf_tensors(
        read_gguf(gguf_file, config), config, device, dtype, attention, max_positions
    )
    log.info(
        "weights: %s (gguf %s kept quantized; the rest %s)",
        _megabytes(weight_bytes(model)),
        ", ".join(f"{t} x{n}" for t, n in sorted(kept.items())) or "nothing",
        str(dtype).split(".")[-1],
    )
    return model


def load_gguf_tensors(
    tensors, config, device, dtype, attention, max_positions
) -> tuple[torch.nn.Module, dict[str, int]]:
    """The model built from GGUF tensors (`backend.loading.gguf_weights.GGUFTensor`), the blocks
    kept where a layer can keep them -> (model, how many layers keep each block type)."""
    from backend.loading.gguf_weights import keep_quantized, load_gguf_weights
    from backend.models.hf_weights import weight_targets

    targets, kept = {}, {}

    def prepare(model: torch.nn.Module) -> None:
        targets.update(weight_targets(model))
        kept.update(keep_quantized(model, tensors, dtype, targets))
        model.materialise_buffers(torch.device("meta"))  # a tied head takes the kept blocks

    model = build_model(config, device, dtype, attention, max_positions, prepare)
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    with torch.no_grad():
        load_gguf_weights(model, tensors, targets, ignored=tied)
    return model, kept


def weight_bytes(model: torch.nn.Module) -> int:
    """Resident bytes of the model's parameters and buffers (each shared tensor once)."""
    return sum(t.numel() * t.element_size() for t in chain(model.parameters(), model.buffers()))


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.0f} MB"

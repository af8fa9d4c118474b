"""Load a model: a Hugging Face directory (see backend/loading/model_paths.py for names and files)
-> our model, with safetensors weights or random ones for a preset, or the blocks of a GGUF file
kept quantized (backend/loading/gguf_weights.py). A quantized checkpoint keeps its format; formats
quantized at load round float weights once loaded (the table: backend/weight_formats.py).
The weights' resident size is logged."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Iterator

import torch

from backend.attention import AttentionBackend
from backend.distributed.tensor_parallel import TensorParallel
from backend.loading.presets import init_random_weights, random_weights_spec
from backend.loading.quantized_checkpoint import (
    load_quantized_weights,
    prepare_quantized,
    quantize_at_load,
    quantize_lm_head,
)
from backend.model_config import ModelConfig
from backend.models import FAMILIES
from backend.models.null import NullModel
from backend.quantization import QuantizedWeight
from backend.quantization.fp8 import use_fast_accumulation
from backend.weight_formats import (
    FROM_CHECKPOINT,
    check_exclude,
    check_lm_head,
    check_tensor_parallel,
    pick_quantization,
    quantization_config,
)

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


@dataclass(frozen=True)
class LoadSpec:
    """What to load and how (the model runner's choices and the engine parameters that reach
    the weights)."""

    model_dir: str  # a Hugging Face directory (`backend.loading.model_paths.resolve_model`)
    device: torch.device
    dtype: torch.dtype
    attention: AttentionBackend
    max_positions: int
    model_config: ModelConfig | None = None  # None: the directory's
    gguf_file: str | None = None  # the blocks kept from this file (the directory: the config)
    quantization: str = "none"  # the engine parameter, not "gguf": see `pick_quantization`
    exclude: tuple[str, ...] = ()  # `quantization_exclude`'s fragments
    quantize_lm_head: bool = False
    fp8_fast_accumulation: bool = False  # `backend.quantization.fp8.use_fast_accumulation`


def load_model(spec: LoadSpec, tp: TensorParallel | None = None) -> torch.nn.Module:
    """Build the model for `spec.model_dir` and fill it: safetensors weights, random ones for a
    preset, or, given `gguf_file`, that file's blocks kept quantized. The weight format's rules
    are the table's (backend/weight_formats.py). With `tp`, this rank's shard: each full tensor
    is cut as it is read (a preset's random weights are drawn per shard, so they differ from one
    rank's); float weights only."""
    config = spec.model_config or ModelConfig.from_dir(spec.model_dir)
    if config.model_type == "null":
        return NullModel(config)
    size = tp.size if tp is not None and tp.enabled else 1
    build = (spec.device, spec.dtype, spec.attention, spec.max_positions)
    if spec.gguf_file is not None:
        check_exclude(spec.exclude, "kept GGUF blocks")
        _check_lm_head(spec, "gguf")
        check_tensor_parallel("gguf", size)  # row-parallel layers would cut blocks' columns
        return _load_gguf(spec.gguf_file, config, *build)
    quantization = pick_quantization(spec.quantization, spec.model_dir)
    check_tensor_parallel(quantization, size)  # per-group or per-block scales would be cut
    _check_lm_head(spec, quantization)
    if quantization in FROM_CHECKPOINT and quantization_config(spec.model_dir) is not None:
        check_exclude(spec.exclude, "quantized in the checkpoint")
        model = _load_quantized(spec.model_dir, quantization, config, *build)
        if spec.quantize_lm_head:
            _quantize_lm_head(model, quantization)
        _prepare_quantized(model, spec.dtype)
        _fast_accumulation(model, spec.fp8_fast_accumulation)
        return model
    if quantization == "none":
        check_exclude(spec.exclude, "not quantized (quantization 'none')")
    model = build_model(config, *build, tp=tp)
    random_spec = random_weights_spec(spec.model_dir)
    with torch.no_grad():
        if random_spec is not None:
            seed, std = random_spec.get("seed", 0), random_spec.get("std", 0.02)
            init_random_weights(model, seed=seed, std=std)
        else:
            model.load_weights(iter_safetensors(spec.model_dir))
        quantized = 0
        if quantization != "none":
            quantized = quantize_at_load(model, quantization, spec.exclude)
        if spec.quantize_lm_head:
            _quantize_lm_head(model, quantization)
        _prepare_quantized(model, spec.dtype)
    log.info(
        "weights: %s (%s%s)",
        _megabytes(weight_bytes(model)),
        str(spec.dtype).split(".")[-1],
        f"; {quantization} x{quantized}, quantized at load" if quantized else "",
    )
    _fast_accumulation(model, spec.fp8_fast_accumulation)
    return model


def _check_lm_head(spec: LoadSpec, quantization: str) -> None:
    if spec.quantize_lm_head:
        check_lm_head(quantization, spec.quantization)


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

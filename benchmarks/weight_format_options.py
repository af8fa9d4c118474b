"""The weight-format and KV-cache-dtype options the benchmarks share (docs/weight-formats.md)."""

from __future__ import annotations

import argparse

from backend.config import KV_CACHE_DTYPES
from backend.weight_formats import QUANTIZATIONS


def add_weight_format_options(
    parser: argparse.ArgumentParser, help: str = "weight format (docs/weight-formats.md)"
) -> None:
    """--quantization (one of the engine's formats), --quantize-lm-head and
    --fp8-fast-accumulation."""
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help=help)
    parser.add_argument("--quantize-lm-head", action="store_true", help="the lm_head quantized too")
    parser.add_argument(
        "--fp8-fast-accumulation",
        action="store_true",
        help="fp8 GEMMs of many rows sum without promoting (docs/weight-formats.md)",
    )


def weight_format_fields(args: argparse.Namespace) -> dict:
    """Those options as EngineConfig fields (and a result's)."""
    return dict(
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        fp8_fast_accumulation=args.fp8_fast_accumulation,
    )


def add_kv_cache_dtype_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores (docs/weight-formats.md); auto: the model dtype",
    )

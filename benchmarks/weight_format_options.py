"""The weight-format options the benchmarks share (README, "Weight formats")."""

from __future__ import annotations

import argparse

from backend.config import QUANTIZATIONS


def add_weight_format_options(
    parser: argparse.ArgumentParser, help: str = "weight format (README, Weight formats)"
) -> None:
    """--quantization (one of the engine's formats) and --quantize-lm-head."""
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help=help)
    parser.add_argument("--quantize-lm-head", action="store_true", help="the lm_head quantized too")

"""FP8 GEMMs of many rows with and without fast accumulation (`fp8_fast_accumulation`), on a GPU:
each projection of a preset through the engine's `fp8_linear` (torch's row-wise scaled GEMM),
its time, TFLOP/s, and its error against the float32 product of the same e4m3 operands.

    python -m benchmarks.fp8_accumulation --model llama-3.1-8b --rows 1024 8192 --json F

The reference is the de-quantized operands multiplied in float32, so the error is what the
GEMM adds (accumulation and the bfloat16 output's rounding), not the e4m3 rounding itself.
"""

from __future__ import annotations

import argparse

import torch

from backend.kernels.fp8_gemm import fp8_linear, quantize_rows
from backend.loading.model_paths import resolve_model
from backend.model_config import ModelConfig
from backend.quantization.fp8 import Fp8Weight
from benchmarks.gemv import projection_shapes
from benchmarks.provenance import provenance, save_json


def _us(call, iters: int = 50) -> float:
    for _ in range(5):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fp8_accumulation", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--projections", nargs="+", default=["qkv", "o", "gate_up", "down", "lm_head"])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = ModelConfig.from_dir(resolve_model(args.model))
    torch.manual_seed(0)
    rows = []
    for m in args.rows:
        for name in args.projections:
            n, k = projection_shapes(config)[name]
            weight = Fp8Weight.quantize(torch.randn(n, k, device="cuda") * 0.02)
            xq, x_scales = quantize_rows(torch.randn(m, k, device="cuda"))
            reference = (xq.float() * x_scales) @ weight.dequantize(torch.float32).t()
            row = {"benchmark": "fp8_accumulation", **provenance(xq.device), "model": args.model}
            row.update(projection=name, rows=m, n=n, k=k)
            for fast in (False, True):
                product = lambda: fp8_linear(  # noqa: E731
                    xq,
                    x_scales,
                    weight.qweight,
                    weight.scales,
                    out_dtype=torch.bfloat16,
                    fast_accumulation=fast,
                )
                us = _us(product)
                error = (product().float() - reference).norm() / reference.norm()
                row["fast" if fast else "promoted"] = {
                    "us": round(us, 2),
                    "tflop_s": round(2 * m * n * k / us / 1e6, 1),
                    "relative_error": float(error),
                }
            print(row, flush=True)
            rows.append(row)
    save_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()

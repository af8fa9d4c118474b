"""Each weight format's linear layer against bf16 cuBLAS, on a GPU, for a preset's projections.

Times what a layer runs (`QuantizedWeight.matmul`; `F.linear` for bf16) for x of M rows, over as
many distinct weight copies as the model has layers, inside one CUDA graph (benchmarks/gemv.py's
method): M = 1 is the one-token GEMV, larger M the format's GEMM (fp8: the row quantizer plus the
scaled GEMM). Reports µs per call and the weight-read rate. `--sweep` also times the int8 and
int4 GEMMs' (BLOCK_M, BLOCK_N) tiles at each M and reports the fastest, to check
`backend.kernels.tuning.few_rows_tiles`.

    python -m benchmarks.quantized_matmul --model llama-3.2-1b --rows 1 16 64 256 [--sweep] \
        --json OUT
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from backend.kernels.int4_matmul import int4_gemm
from backend.kernels.int8_matmul import int8_gemm
from backend.model_config import ModelConfig
from backend.model_paths import resolve_model
from backend.quantization import Fp8Weight, Int4Weight, Int8Weight
from benchmarks.gemv import projection_shapes
from benchmarks.graph_timing import graph_us_per_call
from benchmarks.provenance import provenance, save_json

FORMATS = {
    "int8_wo": Int8Weight.quantize,
    "fp8": Fp8Weight.quantize,
    "int4_wo": Int4Weight.quantize,
}
TILES = dict(block_m=[16, 32, 64], block_n=[16, 32, 64, 128])


def _weights(fmt: str, n: int, k: int, copies: int) -> list:
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    return dense if fmt == "bf16" else [FORMATS[fmt](w) for w in dense]


def _nbytes(weight) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return sum(b.numel() * b.element_size() for b in weight.buffers())


def _product(fmt: str):
    if fmt == "bf16":
        return lambda x, w: F.linear(x, w)
    return lambda x, w: w.matmul(x)


def _sweep(fmt: str, x: torch.Tensor, weights: list) -> dict:
    """The fastest GEMM tiles for int8 / int4 at x's rows."""
    timings = []
    for block_m, block_n in itertools.product(*TILES.values()):
        if block_m > 16 and block_m // 2 >= x.shape[0]:
            continue
        if fmt == "int8_wo":

            def call(w, bm=block_m, bn=block_n):
                return int8_gemm(x, w.qweight, w.scales, block_m=bm, block_n=bn)
        else:

            def call(w, bm=block_m, bn=block_n):
                return int4_gemm(
                    x, w.qweight, w.scales, w.zeros, w.group_size, block_m=bm, block_n=bn
                )

        us = graph_us_per_call([lambda w=w, c=call: c(w) for w in weights])
        timings.append((us, block_m, block_n))
    us, block_m, block_n = min(timings)
    return {"best_us": round(us, 2), "block_m": block_m, "block_n": block_n}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quantized_matmul", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--formats", nargs="+", default=["bf16", *FORMATS])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = ModelConfig.from_dir(resolve_model(args.model))
    copies = config.num_layers
    rows = []
    for name, (n, k) in projection_shapes(config).items():
        if name == "lm_head":  # stays dense in every format but gguf
            continue
        for fmt in args.formats:
            weights = _weights(fmt, n, k, copies)
            product = _product(fmt)
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                us = graph_us_per_call([lambda w=w: product(x, w) for w in weights])
                row = {
                    "projection": name,
                    "n": n,
                    "k": k,
                    "format": fmt,
                    "rows": m,
                    "us": round(us, 2),
                    "weight_gb_s": round(_nbytes(weights[0]) / us / 1e3, 1),
                }
                if args.sweep and fmt in ("int8_wo", "int4_wo") and m > 1:
                    row["sweep"] = _sweep(fmt, x, weights)
                print(row, flush=True)
                rows.append(row)
            del weights
            torch.cuda.empty_cache()
    result = [{**provenance(torch.device("cuda")), "model": args.model, **r} for r in rows]
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

"""Each weight format's linear layer against bf16 cuBLAS, on a GPU, for a preset's projections.

Times what a layer runs (`QuantizedWeight.matmul`; `F.linear` for bf16) for x of M rows, over as
many distinct weight copies as the model has layers, inside one CUDA graph (benchmarks/gemv.py's
method): M = 1 is the one-token GEMV, larger M the format's GEMM (fp8: the row quantizer plus the
scaled GEMM). `gguf_*` formats are random blocks of that GGUF type: M = 1 the GEMV over blocks,
larger M the GEMM over blocks up to `GEMM_MAX_ROWS`, then de-quantize + cuBLAS (`dequantize_us`:
that torch path's time at every M). Reports µs per call and the weight-read rate. `--sweep` also
times, at each M > 1, the W8A16 GEMM's launch configs for int8 and e4m3 weights (tiles, K tiles,
K splits, stages), the FP8 W8A8 Triton GEMM's (`fp8_gemm`) against torch's scaled GEMM on
quantized rows, the 4-bit GEMM's (tiles, K splits, stages) and the GEMM over GGUF blocks' (at
M = 1 the GEMV over blocks': rows, blocks, warps, K splits), and reports the fastest.
`--write-tuning` keeps for this device, in `backend/kernels/tuning/`: every
int8 W8A16, 4-bit and GGUF winner; the FP8 Triton GEMM's winner where it beats the scaled GEMM;
and an e4m3 W8A16 winner only where it beats the faster e4m3 product plus, for the projections
whose rows no fused kernel quantizes (o, lm_head), the row quantizer (an e4m3 entry that no
longer wins is dropped).

    python -m benchmarks.quantized_matmul --model llama-3.2-1b --rows 1 16 64 256 [--sweep] \
        [--write-tuning] [--projections qkv o gate_up down lm_head] --json OUT"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import asdict

import torch
import torch.nn.functional as F

from backend.gguf_blocks import BLOCK_TYPES
from backend.kernels import fp8_gemm, gguf_matmul, int4_matmul, tuning
from backend.kernels import gguf_gemv as gguf_gemv_kernel
from backend.kernels.gguf_gemv import GGUFGemvConfig, gguf_gemv
from backend.kernels.gguf_matmul import GGUFGemmConfig, gguf_gemm
from backend.kernels.gguf_values import KERNEL_TYPES as GGUF_TYPES
from backend.kernels.gguf_values import blocks_of_128_values
from backend.kernels.int4_matmul import int4_gemm
from backend.kernels.split_k import SwappedGemmConfig
from backend.kernels.tuning import rows_bucket
from backend.kernels.w8a16_gemm import GemmConfig, config_key, w8a16_gemm
from backend.loading.model_paths import resolve_model
from backend.model_config import ModelConfig
from backend.quantization import WEIGHT_CLASSES, GGUFWeight, QuantizedWeight
from backend.weight_formats import AT_LOAD
from benchmarks.gemv import projection_shapes
from benchmarks.gguf_random import random_rows
from benchmarks.graph_timing import graph_us_per_call
from benchmarks.provenance import provenance, save_json

FORMATS = {name: WEIGHT_CLASSES[name].quantize for name in AT_LOAD}  # quantized at load
W8A16_SPACE = dict(block_n=[32, 64, 128], block_k=[128, 256], split=[1, 2, 4], num_stages=[3, 4])
SWAPPED_SPACE = dict(block_n=[64, 128], split=[1, 2, 4, 8], num_stages=[3, 4])  # FP8, 4-bit
ROWS_QUANTIZED_BY_A_FUSED_KERNEL = ("qkv", "gate_up", "down")  # RMSNorm, silu·mul
GGUF_FORMATS = {f"gguf_{t.lower()}": t for t in GGUF_TYPES}  # random blocks, as a GGUF holds them
GGUF_SPACE = dict(block_n=[32, 64, 128], split=[1, 4, 8], num_stages=[2])
GGUF_GEMV_SPACE = dict(
    block_n=[16, 32], blocks_times=[1, 2, 4], num_warps=[4, 8], split=[1, 2, 4, 8]
)


def _weights(fmt: str, n: int, k: int, copies: int) -> list:
    if fmt in GGUF_FORMATS:
        return [_random_gguf(GGUF_FORMATS[fmt], n, k, seed) for seed in range(copies)]
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    return dense if fmt == "bf16" else [FORMATS[fmt](w) for w in dense]


def _random_gguf(quant_type: str, n: int, k: int, seed: int) -> GGUFWeight:
    blocks = random_rows(quant_type, n, k // BLOCK_TYPES[quant_type].block_size, seed)
    return GGUFWeight(n, k, quant_type, torch.from_numpy(blocks).cuda())


def _nbytes(weight) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return sum(b.numel() * b.element_size() for b in weight.buffers())


def _product(fmt: str):
    if fmt == "bf16":
        return lambda x, w: F.linear(x, w)
    return lambda x, w: w.matmul(x)


def _time(call, weights: list) -> float:
    return graph_us_per_call([lambda w=w: call(w) for w in weights])


def _swapped_configs(
    x: torch.Tensor, block_ks: list[int], half_rows: bool = False
) -> list[SwappedGemmConfig]:
    """The FP8 and 4-bit GEMMs' configs to time at x's rows: SWAPPED_SPACE by the K tiles, row
    tiles of the rows' bucket up to 64 and up to 128, and 8 warps too for 128-row weight tiles.
    `half_rows`: also row tiles of half the bucket (twice the programs, for kernels that wait
    more than they compute)."""
    rows = rows_bucket(x.shape[0])
    row_tiles = {min(64, rows), min(128, rows)}
    if half_rows and rows >= 32:
        row_tiles.add(min(64, rows // 2))
    return [
        SwappedGemmConfig(block_n, block_m, block_k, split, warps, stages)
        for block_n, split, stages in itertools.product(*SWAPPED_SPACE.values())
        for block_k in block_ks
        for block_m in sorted(row_tiles)
        for warps in ([4, 8] if block_n == 128 else [4])
    ]


def _sweep_int4(x: torch.Tensor, weights: list) -> dict:
    """The fastest 4-bit GEMM config at x's rows."""
    configs = _swapped_configs(x, block_ks=[min(weights[0].group_size, 128)], half_rows=True)

    def gemm(w, config):
        return int4_gemm(x, w.qweight, w.scale_zero, w.group_size, None, config)

    us, config = _best(configs, gemm, weights)
    return {"best_us": round(us, 2), "config": asdict(config)}


def _best(configs, product, weights: list) -> tuple[float, object]:
    """The fastest of `configs` for product(w, config) over the weights: (µs, config)."""
    timings = []
    for config in configs:
        try:
            timings.append((_time(lambda w, c=config: product(w, c), weights), config))
        except Exception as exc:  # e.g. more shared memory than the device has
            print(f"skipped {config}: {type(exc).__name__}", flush=True)
    return min(timings, key=lambda timing: timing[0])


def _sweep_gguf(x: torch.Tensor, weights: list) -> dict:
    """The fastest GEMM-over-blocks config at x's rows."""
    quant_type = weights[0].quant_type
    blocks = blocks_of_128_values(quant_type)
    configs = [
        GGUFGemmConfig(block_n, min(64, rows_bucket(x.shape[0])), blocks, split, 4, stages)
        for block_n, split, stages in itertools.product(*GGUF_SPACE.values())
    ]
    us, config = _best(configs, lambda w, c: gguf_gemm(x, w.qweight, quant_type, None, c), weights)
    return {"best_us": round(us, 2), "config": asdict(config)}


def _sweep_gguf_gemv(x: torch.Tensor, weights: list) -> dict:
    """The fastest one-row GEMV-over-blocks config."""
    quant_type = weights[0].quant_type
    blocks = blocks_of_128_values(quant_type)
    configs = [
        GGUFGemvConfig(block_n, blocks * times, warps, split)
        for block_n, times, warps, split in itertools.product(*GGUF_GEMV_SPACE.values())
    ] + [GGUFGemvConfig(64, blocks * times, warps) for times in (1, 2, 4) for warps in (4, 8)]
    us, config = _best(configs, lambda w, c: gguf_gemv(x, w.qweight, quant_type, None, c), weights)
    return {"best_us": round(us, 2), "config": asdict(config)}


def _sweep_w8a16(x: torch.Tensor, weights: list) -> dict:
    """The fastest W8A16 config at x's rows."""
    block_m = min(64, rows_bucket(x.shape[0]))
    configs = [
        GemmConfig(block_m, block_n, block_k, split, 4 if block_n < 128 else 8, stages)
        for block_n, block_k, split, stages in itertools.product(*W8A16_SPACE.values())
    ]
    us, config = _best(configs, lambda w, c: w8a16_gemm(x, w.qweight, w.scales, None, c), weights)
    return {"best_us": round(us, 2), "config": asdict(config)}


def _sweep_fp8(x: torch.Tensor, weights: list) -> dict:
    """On rows quantized beforehand: the scaled GEMM's time and the fastest Triton FP8 GEMM
    config; and the row quantizer's time alone."""
    xq, x_scales = fp8_gemm.quantize_rows(x)
    configs = _swapped_configs(x, block_ks=[128, 256])

    def triton_gemm(w, config):
        return fp8_gemm.fp8_linear(
            xq, x_scales, w.qweight, w.scales, out_dtype=x.dtype, config=config
        )

    def scaled(w):
        return torch._scaled_mm(
            xq, w.qweight.t(), scale_a=x_scales, scale_b=w.scales.view(1, -1), out_dtype=x.dtype
        )

    us, config = _best(configs, triton_gemm, weights)
    return {
        "best_us": round(us, 2),
        "config": asdict(config),
        "scaled_us": round(_time(scaled, weights), 2),
        "quantize_rows_us": round(_time(lambda w: fp8_gemm.quantize_rows(x), weights), 2),
    }


def _choose_fp8(name: str, w8a16: dict, fp8: dict) -> tuple[dict | None, dict | None]:
    """(the FP8 Triton GEMM's entry or None, the e4m3 W8A16 entry or None) from both sweeps."""
    triton_wins = fp8["best_us"] < fp8["scaled_us"]
    e4m3_us = min(fp8["best_us"], fp8["scaled_us"])
    if name not in ROWS_QUANTIZED_BY_A_FUSED_KERNEL:
        e4m3_us += fp8["quantize_rows_us"]
    w8a16_wins = w8a16["best_us"] < e4m3_us
    return (fp8["config"] if triton_wins else None), (w8a16["config"] if w8a16_wins else None)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quantized_matmul", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument(
        "--formats",
        nargs="+",
        default=["bf16", *FORMATS],
        help=f"of bf16, {', '.join(FORMATS)}, {', '.join(GGUF_FORMATS)} (random GGUF blocks)",
    )
    p.add_argument(
        "--projections",
        nargs="+",
        default=["qkv", "o", "gate_up", "down"],
        help="of qkv, o, gate_up, down, lm_head (quantized with quantize_lm_head)",
    )
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--write-tuning", action="store_true", help="keep the sweeps' winners")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = ModelConfig.from_dir(resolve_model(args.model))
    tuned = {"w8a16_gemm": {}, "fp8_gemm": {}, "int4_gemm": {}, "gguf_gemm": {}, "gguf_gemv": {}}
    rows = []
    for name in args.projections:
        n, k = projection_shapes(config)[name]
        copies = 2 if name == "lm_head" else config.num_layers  # 2 lm_heads overflow L2 already
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
                if m > 1 and fmt in GGUF_FORMATS:  # against de-quantizing, then cuBLAS
                    torch_us = _time(lambda w: QuantizedWeight.matmul(w, x), weights)
                    row["dequantize_us"] = round(torch_us, 2)
                if args.sweep and m > 1 and fmt == "int8_wo":
                    row["sweep"] = sweep = _sweep_w8a16(x, weights)
                    tuned["w8a16_gemm"][config_key(torch.int8, n, k, m)] = sweep["config"]
                elif args.sweep and m > 1 and fmt == "fp8":
                    row["sweep"] = sweep = _sweep_w8a16(x, weights)
                    row["fp8_sweep"] = fp8 = _sweep_fp8(x, weights)
                    fp8_entry, w8a16_entry = _choose_fp8(name, sweep, fp8)
                    tuned["fp8_gemm"][fp8_gemm.config_key(n, k, m)] = fp8_entry
                    tuned["w8a16_gemm"][config_key(weights[0].qweight.dtype, n, k, m)] = w8a16_entry
                elif args.sweep and m > 1 and fmt == "int4_wo":
                    row["sweep"] = sweep = _sweep_int4(x, weights)
                    key = int4_matmul.config_key(n, k, weights[0].group_size, m)
                    tuned["int4_gemm"][key] = sweep["config"]
                elif args.sweep and m == 1 and fmt in GGUF_FORMATS:
                    row["sweep"] = sweep = _sweep_gguf_gemv(x, weights)
                    key = gguf_gemv_kernel.config_key(GGUF_FORMATS[fmt], n, k)
                    tuned["gguf_gemv"][key] = sweep["config"]
                elif args.sweep and m > 1 and fmt in GGUF_FORMATS:
                    row["sweep"] = sweep = _sweep_gguf(x, weights)
                    key = gguf_matmul.config_key(GGUF_FORMATS[fmt], n, k, m)
                    tuned["gguf_gemm"][key] = sweep["config"]
                print(row, flush=True)
                rows.append(row)
            del weights
            torch.cuda.empty_cache()
    if args.write_tuning:
        device = torch.cuda.get_device_name()
        source = f"python -m benchmarks.quantized_matmul --sweep, {args.model}, rows {args.rows}"
        for kernel, configs in tuned.items():
            if configs:
                print("wrote", tuning.write(kernel, device, configs, source))
    result = [{**provenance(torch.device("cuda")), "model": args.model, **r} for r in rows]
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

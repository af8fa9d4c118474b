"""The one-token linear kernel (backend/kernels/gemv.py) against cuBLAS, on a GPU.

For the projections of a preset model with one token: time per call, measured as in a decode
step: one CUDA graph runs the product over as many distinct weight copies as the model has layers
(so weights come from memory, not L2, and there is no launch gap from the host), replayed and
timed with CUDA events. Reported with the weight-read rate as a fraction of the device-to-device
copy rate measured in the same run. `--sweep` also times a grid of tile shapes, warps and pipeline
stages per shape and reports the fastest.

`--chain` times what a batch-1 decode step runs instead: per layer qkv (+RMSNorm), o (+residual),
gate_up (+RMSNorm), down (+silu·mul, +residual), then lm_head, all in one CUDA graph, where a
kernel's start overlaps its predecessor's end (prefetch, early launch). With `--sweep` it improves
the per-projection configs one projection at a time (one pass of coordinate descent) from
`launch_config`'s (this GPU's table entries, else the default rule); `--weight int8|e4m3` stores
the decoder projections so (one byte a value and a scale per row, as `int8_wo` / `fp8` layers
stream them; `--weight int4`: 4-bit rows in groups of 128, as `int4_wo`), `--lm-head-weight`
the lm_head (`quantize_lm_head`; then it is swept too). With `--wait-cost` it also times the
chain with the kernels' waits for their predecessor skipped (a diagnostic: the results are
wrong, the weights stream exactly as before), for every projection and for each kind alone: the
difference is what waiting for the previous kernel costs. `--chain --sweep --write-tuning` also
writes the configs it kept into `backend/kernels/tuning/gemv.json` under this GPU's name (review
the diff before committing: a one-pass sweep's gains may be noise, see the README).

    python -m benchmarks.gemv --model llama-3.2-1b [--chain [--wait-cost]] \
        [--weight e4m3 --lm-head-weight e4m3] [--sweep [--write-tuning]] --json OUT
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from backend.kernels import tuning
from backend.kernels.gemv import gemv
from backend.kernels.gemv_config import launch_config, tuning_key
from backend.kernels.gemv_weight import StreamedWeight
from backend.loading.model_paths import resolve_model
from backend.model_config import ModelConfig
from backend.quantization import Fp8Weight, Int4Weight, Int8Weight
from benchmarks.decode_floor import copy_rate_bytes_per_s
from benchmarks.graph_timing import graph_us_per_call
from benchmarks.provenance import provenance, save_json

QUANTIZERS = {"int8": Int8Weight.quantize, "e4m3": Fp8Weight.quantize, "int4": Int4Weight.quantize}
FORMAT_NAMES = {"int8": "int8", "e4m3": "float8_e4m3fn", "int4": "int4g128"}  # its .format
SWEEP = dict(BLOCK_N=[4, 8, 16, 32], BLOCK_K=[256, 512], num_warps=[4, 8], num_stages=[2, 4])


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the weight."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv": (q + 2 * kv, config.hidden_size),
        "o": (config.hidden_size, q),
        "gate_up": (2 * config.intermediate_size, config.hidden_size),
        "down": (config.hidden_size, config.intermediate_size),
        "lm_head": (config.vocab_size, config.hidden_size),
    }


def time_us(product, x, weights, replays: int = 20) -> float:
    """Per-call GPU time of `product(x, w)` over every weight copy, from one CUDA graph."""
    return graph_us_per_call([lambda w=w: product(x, w) for w in weights], replays)


def configs(k: int):
    for values in itertools.product(*SWEEP.values()):
        config = dict(zip(SWEEP, values))
        if k % config["BLOCK_K"] == 0:
            yield config


def measure(name: str, n: int, k: int, copies: int, sweep: bool, copy_rate: float) -> dict:
    """One projection: cuBLAS and the GEMV per call, and with `sweep` the fastest configs."""
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
    ]
    weight_bytes = weights[0].numel() * weights[0].element_size()
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    error = float((gemv(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max())
    default = launch_config(n, k, device_name=tuning.device_name(x.device))
    row = {
        "projection": name,
        "n": n,
        "k": k,
        "weight_mb": round(weight_bytes / 1e6, 1),
        "max_abs_diff_vs_cublas": error,
        "cublas_us": round(time_us(F.linear, x, weights), 2),
        "gemv_us": round(time_us(gemv, x, weights), 2),
        "default_config": default,
    }
    if sweep:
        timings = []
        for c in configs(k):
            try:
                timings.append((time_us(lambda a, w: gemv(a, w, config=c), x, weights), c))
            except Exception as exc:  # e.g. out of shared memory for this tile shape
                timings.append((float("inf"), {**c, "error": type(exc).__name__}))
        timings.sort(key=lambda t: t[0])
        row["best_us"], row["best_config"] = round(timings[0][0], 2), timings[0][1]
        row["next_best"] = [{"us": round(t, 2), **c} for t, c in timings[1:4]]
    for key in ("cublas_us", "gemv_us", "best_us"):
        if key in row:
            rate = weight_bytes / (row[key] * 1e-6)
            row[key.replace("_us", "_fraction_of_copy_rate")] = round(rate / copy_rate, 3)
    return row


CHAIN_GRID = dict(BLOCK_N=[4, 8], num_warps=[4, 8], num_stages=[2, 4], EARLY_LAUNCH=[False, True])
# One-byte rows hold twice the values in the same bytes: wider K tiles and row blocks too.
ONE_BYTE_GRID = dict(CHAIN_GRID, BLOCK_N=[4, 8, 16], EARLY_LAUNCH=[True])
# 4-bit rows: K tiles of whole groups; more rows a program reuse each thread's operand columns.
FOUR_BIT_GRID = dict(
    BLOCK_N=[4, 8, 16, 32, 64], num_warps=[4, 8], num_stages=[2], EARLY_LAUNCH=[False], SPLIT=[1]
)
LM_HEAD_GRID = dict(BLOCK_N=[8, 16, 32], num_warps=[4, 8], num_stages=[2, 4], EARLY_LAUNCH=[True])
FOUR_BIT_LM_HEAD_GRID = dict(
    BLOCK_N=[16, 32, 64, 128], num_warps=[4, 8], num_stages=[2], EARLY_LAUNCH=[True]
)
# 4-bit tiles of at most 32 words a thread: the tile, the next one read ahead and the per-word sums
# stay in registers.
FOUR_BIT_WORDS_A_THREAD = 32


def chain_candidates(
    n: int,
    k: int,
    one_byte: bool = False,
    lm_head: bool = False,
    four_bit: bool = False,
    split_k: bool = False,
):
    """Configs for one projection of the chain: the grid, prefetching 0, 2048 or all of K (at
    most 256 values a thread held); one-byte rows try 512- and 1024-wide K tiles, launched
    early (every bf16 sweep kept early launches); 4-bit rows 256- to 2048-wide K tiles and no
    prefetch (they read their first tile before the wait whatever PREFETCH_K says), and with
    `split_k` (an operand without the norm) K split over 1, 2 or 4 programs."""
    if lm_head:
        grid = FOUR_BIT_LM_HEAD_GRID if four_bit else LM_HEAD_GRID
    elif four_bit:
        grid = dict(FOUR_BIT_GRID, SPLIT=[1, 2, 4]) if split_k else FOUR_BIT_GRID
    else:
        grid = ONE_BYTE_GRID if one_byte else CHAIN_GRID
    widths = (256, 512, 1024, 2048) if four_bit else (512, 1024) if one_byte else (512,)
    widths = [w for w in widths if k % w == 0] or [64]
    for values in itertools.product(*grid.values()):
        for block_k in widths:
            config = dict(zip(grid, values), BLOCK_K=block_k)
            for prefetch in [0] if four_bit else sorted({0, min(2048, k), k}):
                fits = config["BLOCK_N"] * prefetch <= 256 * 32 * config["num_warps"]
                words = config["BLOCK_N"] * block_k // 8
                fits &= not four_bit or words <= FOUR_BIT_WORDS_A_THREAD * 32 * config["num_warps"]
                if fits and prefetch % block_k == 0 and prefetch & (prefetch - 1) == 0:
                    yield {**config, "PREFETCH_K": prefetch}


def stored(weight: torch.Tensor, fmt: str) -> torch.Tensor | StreamedWeight:
    """A bf16 weight as the format `fmt` (bf16, int8, e4m3, int4 in groups of 128) streams it."""
    if fmt == "bf16":
        return weight
    return QUANTIZERS[fmt](weight).streamed()


def _nbytes(weight: torch.Tensor | StreamedWeight) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    parts = (weight.values, weight.scales, weight.scale_zero)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def measure_chain(
    config: ModelConfig,
    sweep: bool,
    copy_rate: float,
    wait_cost: bool = False,
    weight: str = "bf16",
    lm_head_weight: str = "bf16",
) -> dict:
    """The one-token projection chain of a decode step over every layer's own weights, stored
    as `weight` (the lm_head as `lm_head_weight`)."""
    shapes = projection_shapes(config)
    hidden, q_size = config.hidden_size, config.num_heads * config.head_dim

    def random(name, fmt):
        dense = torch.randn(*shapes[name], device="cuda", dtype=torch.bfloat16)
        return stored(dense / shapes[name][1] ** 0.5, fmt)

    layers = [
        {name: random(name, weight) for name in ("qkv", "o", "gate_up", "down")}
        for _ in range(config.num_layers)
    ]
    lm_head = random("lm_head", lm_head_weight)
    norm = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    stream = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    nbytes = sum(_nbytes(w) for layer in layers for w in layer.values()) + _nbytes(lm_head)
    formats = {name: None if weight == "bf16" else FORMAT_NAMES[weight] for name in shapes}
    formats["lm_head"] = None if lm_head_weight == "bf16" else FORMAT_NAMES[lm_head_weight]

    def step(configs):
        def run(x, _):
            for layer in layers:
                qkv = gemv(x, layer["qkv"], norm_weight=norm, eps=1e-5, config=configs["qkv"])
                gemv(qkv[:, :q_size], layer["o"], residual=x, out=x, config=configs["o"])
                gate_up = gemv(
                    x, layer["gate_up"], norm_weight=norm, eps=1e-5, config=configs["gate_up"]
                )
                gemv(
                    gate_up, layer["down"], silu_mul=True, residual=x, out=x, config=configs["down"]
                )
            return gemv(x, lm_head, config=configs["lm_head"])

        return time_us(run, stream, [None])

    device_name = tuning.device_name(stream.device)
    defaults = {
        name: launch_config(*shapes[name], device_name=device_name, weight_format=formats[name])
        for name in shapes
    }
    best = defaults
    floor_us = nbytes / copy_rate * 1e6
    row = {
        "projections": "qkv, o, gate_up, down per layer; lm_head",
        "weight": weight,
        "lm_head_weight": lm_head_weight,
        "formats": formats,
        "weight_mb": round(nbytes / 1e6, 1),
        "floor_us": round(floor_us, 1),
        "default_us": round(step(defaults), 1),
        "default_configs": dict(defaults),
    }
    if sweep:
        best_us, tried = row["default_us"], 0
        swept = ("down", "gate_up", "qkv", "o") + (("lm_head",) if lm_head_weight != "bf16" else ())
        for name in swept:
            stored_format = formats[name] or ""
            for candidate in chain_candidates(
                *shapes[name],
                one_byte=bool(stored_format),
                lm_head=name == "lm_head",
                four_bit=stored_format.startswith("int4"),
                split_k=name in ("o", "down"),  # no norm before them
            ):
                trial = {**best, name: candidate}
                try:
                    us = step(trial)
                except Exception:  # e.g. out of registers or shared memory for this shape
                    continue
                tried += 1
                if us < best_us * 0.995:
                    best_us, best = us, trial
        row.update(
            best_us=round(best_us, 1),
            best_configs=best,
            configs_tried=tried,
            best_fraction_of_floor=round(floor_us / best_us, 3),
        )
    if wait_cost:
        row.update(wait_cost_us(step, defaults, row["default_us"]))
    row["default_fraction_of_floor"] = round(floor_us / row["default_us"], 3)
    return row


def wait_cost_us(step, configs: dict, first_default_us: float) -> dict:
    """The chain timed with the waits skipped: everywhere, then for one kind of projection at a
    time; the defaults timed again at the end, and the faster of the two runs kept (the first
    timing of a run tends to be the slowest)."""

    def without_wait(names):
        return step({n: {**c, "SKIP_WAIT": True} if n in names else c for n, c in configs.items()})

    result = {
        "no_wait_us": round(without_wait(set(configs)), 1),
        "no_wait_one_kind_us": {name: round(without_wait({name}), 1) for name in configs},
    }
    result["default_us"] = round(min(first_default_us, step(configs)), 1)
    return result


def write_tuning(config: ModelConfig, row: dict, result_path: str | None) -> None:
    """The chain sweep's kept config per projection, keyed by its weight's shape, into the table."""
    shapes, formats = projection_shapes(config), row["formats"]
    configs = {
        tuning_key(*shapes[name], weight_format=formats[name]): dict(best)
        for name, best in row["best_configs"].items()
    }
    source = f"benchmarks.gemv --chain --sweep at {row['commit']}, {row['date']}" + (
        f" ({result_path})" if result_path else ""
    )
    print("wrote", tuning.write("gemv", row["device"], configs, source))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gemv", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--sweep", action="store_true")
    p.add_argument(
        "--chain", action="store_true", help="time a decode step's whole chain of products"
    )
    p.add_argument(
        "--wait-cost",
        action="store_true",
        help="with --chain: also time it with the waits for the previous kernel skipped",
    )
    p.add_argument(
        "--write-tuning",
        action="store_true",
        help="with --chain --sweep: write the kept configs into this GPU's tuning table",
    )
    p.add_argument(
        "--weight",
        choices=["bf16", *QUANTIZERS],
        default="bf16",
        help="with --chain: how the decoder projections are stored",
    )
    p.add_argument(
        "--lm-head-weight",
        choices=["bf16", *QUANTIZERS],
        default="bf16",
        help="with --chain: how the lm_head is stored (quantize_lm_head)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.write_tuning and not (args.chain and args.sweep):
        p.error("--write-tuning needs --chain --sweep")
    device = torch.device("cuda")
    config = ModelConfig.from_dir(resolve_model(args.model))
    copy_rate = copy_rate_bytes_per_s(device)
    if args.chain:
        row = {
            "benchmark": "gemv_chain",
            **provenance(device),
            "model": args.model,
            "copy_rate_tb_s": round(copy_rate / 1e12, 3),
            **measure_chain(
                config, args.sweep, copy_rate, args.wait_cost, args.weight, args.lm_head_weight
            ),
        }
        print(json.dumps(row), flush=True)
        save_json(args.json, row)
        if args.write_tuning:
            write_tuning(config, row, args.json)
        return [row]
    results = []
    for name, (n, k) in projection_shapes(config).items():
        copies = config.num_layers if name != "lm_head" else 2
        row = {
            "benchmark": "gemv",
            "model": args.model,
            **measure(name, n, k, copies, args.sweep, copy_rate),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
        save_json(
            args.json,
            {**provenance(device), "copy_rate_tb_s": round(copy_rate / 1e12, 3), "rows": results},
        )  # after every row: a cut-off run keeps its rows
    return results


if __name__ == "__main__":
    main()

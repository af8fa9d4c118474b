"""The element-wise kernels of an `fp8` step at a model's shapes, by launch config: RMSNorm with
the residual add writing e4m3 rows, silu·mul writing e4m3 rows, and the rotary embedding with its
KV-cache write (an fp8 cache: fused, or followed by the KV-write kernel). Times are per call,
from CUDA-graph replays over enough buffer copies that no call finds its input in L2 from the
call before; rates count the bytes each kernel must move.

    python -m benchmarks.elementwise --model llama-3.1-8b --rows 16 64 256 1024 4096 8192 \\
        --out benchmarks/results/elementwise_llama8b_h100.json
"""

from __future__ import annotations

import argparse

import torch

from backend.attention.kernels.kv_write import write_kv
from backend.attention.kernels.rope import apply_rotary_
from backend.kernels.activation import silu_and_mul_e4m3
from backend.kernels.rmsnorm import rms_norm
from backend.layers.rotary import RotaryEmbedding
from backend.loading.model_paths import resolve_model
from backend.model_config import ModelConfig
from benchmarks.graph_timing import graph_us_per_call
from benchmarks.provenance import provenance, save_json

BUFFER_BYTES = 256 << 20  # the copies' total: well past the 50 MB L2 of an H100
TOKENS_PER_BLOCK = 32


def copies_of(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, min(16, BUFFER_BYTES // max(nbytes, 1))))]


def time_rms_norm(rows: int, config: ModelConfig) -> list[dict]:
    hidden = config.hidden_size
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    nbytes = rows * hidden * (2 + 2 + 2 + 1)  # x and residual in, residual and e4m3 out
    inputs = copies_of(
        lambda: (
            torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
        ),
        nbytes,
    )
    out = []
    for warps in (1, 2, 4, 8, 16):
        calls = [
            lambda x=x, r=r, w=warps: rms_norm(x, weight, 1e-5, r, e4m3=True, num_warps=w)
            for x, r in inputs
        ]
        us = graph_us_per_call(calls)
        out.append(result(f"rms_norm_e4m3 hidden={hidden}", rows, f"w{warps}", us))
    return with_rates(out, nbytes)


def time_silu(rows: int, config: ModelConfig) -> list[dict]:
    size = config.intermediate_size
    nbytes = rows * size * (2 + 2 + 1)
    inputs = copies_of(
        lambda: torch.randn(rows, 2 * size, device="cuda", dtype=torch.bfloat16), nbytes
    )
    out = []
    for warps in (4, 8, 16, 32):
        calls = [lambda g=g, w=warps: silu_and_mul_e4m3(g, num_warps=w) for g in inputs]
        us = graph_us_per_call(calls)
        out.append(result(f"silu_and_mul_e4m3 I={size}", rows, f"w{warps}", us))
    return with_rates(out, nbytes)


def time_rope(rows: int, config: ModelConfig) -> list[dict]:
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    rotary = RotaryEmbedding(config.rope, head_dim, config.max_position_embeddings, 4096)
    rotary.build_cache("cuda")
    blocks = rows // TOKENS_PER_BLOCK + 1
    q_bytes, kv_bytes = rows * heads * head_dim * 2, rows * kv_heads * head_dim * 2
    nbytes = 2 * q_bytes + 3 * kv_bytes + kv_bytes  # q and k in and out, v in, K|V fp8 out

    def make():
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device="cuda").bfloat16()
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        cache = torch.empty(blocks, TOKENS_PER_BLOCK, kv_heads, head_dim, device="cuda")
        scales = torch.empty(blocks, TOKENS_PER_BLOCK, kv_heads, device="cuda").bfloat16()
        return (
            q.view(rows, heads, head_dim),
            k.view(rows, kv_heads, head_dim),
            v.view(rows, kv_heads, head_dim),
            cache.to(torch.float8_e4m3fn),
            cache.to(torch.float8_e4m3fn),
            scales,
            scales.clone(),
        )

    inputs = copies_of(make, nbytes)
    positions = torch.randint(0, 4096, (rows,), device="cuda")
    slots = torch.randperm(blocks * TOKENS_PER_BLOCK, device="cuda")[:rows].int()
    name = f"rope_fp8_kv heads={heads} kv_heads={kv_heads} D={head_dim}"
    out = []
    for warps in (1, 2, 4, 8):
        calls = [
            lambda q=q, k=k, v=v, kc=kc, vc=vc, ks=ks, vs=vs, w=warps: apply_rotary_(
                q, k, rotary.cos_sin, positions, (v, kc, vc, slots), (ks, vs), num_warps=w
            )
            for q, k, v, kc, vc, ks, vs in inputs
        ]
        us = graph_us_per_call(calls)
        out.append(result(name, rows, f"fused w{warps}", us))
    calls = [
        lambda q=q, k=k, v=v, kc=kc, vc=vc, ks=ks, vs=vs: (
            apply_rotary_(q, k, rotary.cos_sin, positions),
            write_kv(k, v, kc, vc, slots, ks, vs),
        )
        for q, k, v, kc, vc, ks, vs in inputs
    ]
    us = graph_us_per_call(calls)
    out.append(result(name, rows, "rope w4, then kv_write", us))
    return with_rates(out, nbytes)


def result(kernel: str, rows: int, label: str, us: float) -> dict:
    return dict(kernel=kernel, rows=rows, label=label, us=us)


def with_rates(rows: list[dict], nbytes: int) -> list[dict]:
    for r in rows:
        r["bytes"] = nbytes
        r["tb_per_s"] = round(nbytes / (r["us"] * 1e-6) / 1e12, 3)
        r["us"] = round(r["us"], 2)
    return rows


def plot(path: str, run: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plot import save_beside

    kernels = list(dict.fromkeys(r["kernel"] for r in run["results"]))
    fig, axes = plt.subplots(1, len(kernels), figsize=(7 * len(kernels), 5), squeeze=False)
    for ax, kernel in zip(axes[0], kernels):
        rows = [r for r in run["results"] if r["kernel"] == kernel]
        configs = list(dict.fromkeys(r["label"] for r in rows))
        counts = sorted({r["rows"] for r in rows})
        width = 0.8 / len(counts)
        for i, count in enumerate(counts):
            rates = {r["label"]: r["tb_per_s"] for r in rows if r["rows"] == count}
            ax.barh(
                [j + i * width for j in range(len(configs))],
                [rates.get(c, 0) for c in configs],
                width,
                label=f"{count} rows",
            )
        ax.set_yticks([j + 0.4 - width / 2 for j in range(len(configs))], configs, fontsize=7)
        ax.set(xlabel="TB/s (bytes the kernel must move / time)", title=kernel)
        ax.legend(fontsize=7)
    return save_beside(fig, [run], path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 1024, 8192])
    parser.add_argument("--out", help="write the results here (JSON, and a PNG beside it)")
    args = parser.parse_args(argv)
    config = ModelConfig.from_dir(resolve_model(args.model))
    run = dict(benchmark="elementwise", model=args.model, **provenance("cuda"), results=[])
    for rows in args.rows:
        for measure in (time_rms_norm, time_silu, time_rope):
            for r in measure(rows, config):
                run["results"].append(r)
                print(
                    f"{r['kernel']:48} {rows:5} rows  {r['label']:24} {r['us']:8.2f} µs"
                    f"  {r['tb_per_s']:.2f} TB/s"
                )
    if args.out:
        save_json(args.out, run)
        print("wrote", args.out, plot(args.out, run))
    return run


if __name__ == "__main__":
    main()

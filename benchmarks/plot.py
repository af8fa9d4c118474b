"""Plots of committed results (PNG beside the JSON), and the headline table's rows
(benchmarks/README.md).

python -m benchmarks.plot benchmarks/results
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


def plot_decode_floor(path: str) -> str:
    rows = load(path)
    batches = [r["batch"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(batches, [r["step_ms"] for r in rows], "o-", label="engine decode step")
    ax1.plot(
        batches, [r["floor_ms"] for r in rows], "s--", label="floor: weights + KV at copy rate"
    )
    ax1.set(xscale="log", xlabel="batch", ylabel="ms per step", title="Decode step vs memory floor")
    ax1.legend()
    ax2.plot(batches, [b / r["step_ms"] * 1e3 for b, r in zip(batches, rows)], "o-")
    ax2.set(
        xscale="log", xlabel="batch", ylabel="output tokens/s", title="Decode throughput vs batch"
    )
    r0 = rows[0]
    fig.suptitle(
        f"{r0['model']} {r0['dtype']}, ISL {r0['isl']} — {r0['device']}, "
        f"{r0['date']}, {r0['commit']}",
        fontsize=9,
    )
    fig.tight_layout()
    out = path.replace(".json", ".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def variant_label(r: dict) -> str:
    """A decode-floor row's weight format, KV dtype and window, where not the default."""
    parts = [r.get("quantization", "none") + (" + lm_head" if r.get("quantize_lm_head") else "")]
    if r.get("fp8_fast_accumulation"):
        parts.append("fast accumulation")
    if r.get("kv_cache_dtype", "auto") != "auto":
        parts.append(f"kv {r['kv_cache_dtype']}")
    if r.get("max_attention_window_size"):
        parts.append(f"window {r['max_attention_window_size']}")
    if r.get("tensor_parallel_size", 1) > 1:
        parts.append(f"TP {r['tensor_parallel_size']}")
    if r.get("label_note"):
        parts.append(r["label_note"])
    return ", ".join(parts) + f"\ncontext {r['isl']}" * ("max_attention_window_size" in r)


def plot_decode_context(paths: list[str], out: str) -> str:
    """Decode step against the memory floor across contexts: one line per (commit, batch), step
    time on the left, fraction of the floor on the right (files of `decode_floor --isl ...`)."""
    rows = [r for path in paths for r in load(path) if "step_ms" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = dict.fromkeys((r["commit"], r["batch"]) for r in rows)
    for commit, batch in lines:
        kept = sorted(
            (r for r in rows if (r["commit"], r["batch"]) == (commit, batch)),
            key=lambda r: r["isl"],
        )
        label = f"batch {batch}, {commit}, max_seq_len {kept[0].get('max_seq_len', '?')}"
        contexts = [r["isl"] for r in kept]
        ax1.plot(contexts, [r["step_ms"] for r in kept], "o-", label=label)
        ax2.plot(contexts, [r["fraction_of_floor"] for r in kept], "o-", label=label)
        if commit == rows[-1]["commit"]:
            ax1.plot(contexts, [r["floor_ms"] for r in kept], "k:", linewidth=1)
    ax1.set(xscale="log", yscale="log", xlabel="context (prompt tokens)", ylabel="ms per step")
    ax1.set_title("decode step (dotted: memory floor)", fontsize=9)
    ax2.set(xscale="log", xlabel="context (prompt tokens)", ylabel="floor / step", ylim=(0, 1))
    ax2.set_title(f"{rows[0]['model']} {rows[0]['dtype']}: fraction of the floor", fontsize=9)
    ax2.legend(fontsize=7)
    fig.suptitle(f"{rows[0]['device']} · {rows[-1]['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_variants(path: str) -> str:
    """Decode step and floor of each variant (weight format, KV dtype, window), per batch."""
    rows = load(path)
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        picked = [r for r in rows if r["batch"] == batch]
        x = range(len(picked))
        ax.bar([i - 0.2 for i in x], [r["step_ms"] for r in picked], 0.4, label="decode step")
        ax.bar([i + 0.2 for i in x], [r["floor_ms"] for r in picked], 0.4, label="memory floor")
        labels = [variant_label(r) for r in picked]
        many = len(picked) * max(map(len, labels)) > 120  # slanted labels, or they overlap
        ax.set_xticks(
            list(x),
            labels,
            fontsize=7,
            rotation=40 if many else 0,
            ha="right" if many else "center",
        )
        ax.set(ylabel="ms per step", title=f"{rows[0]['model']}, batch {batch}")
        ax.legend()
    return save_beside(fig, rows, path)


def plot_attention_sweep(path: str) -> str:
    """Decode attention per batch shape: the table's config before the sweep and after it (the
    heuristic's split count), one panel per head size."""
    run = load(path)[0]
    setups = list(dict.fromkeys(r["setup"] for r in run["rows"]))
    fig, axes = plt.subplots(1, len(setups), figsize=(7 * len(setups), 4.5), squeeze=False)
    for ax, setup in zip(axes[0], setups):
        rows = [r for r in run["rows"] if r["setup"] == setup]
        head_dim = int(re.search(r"D=(\d+)", setup).group(1))
        shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
        before, after = [], []
        for batch, context in shapes:
            few = "1" if 8 * batch * 8 <= 132 else "0"  # decode_launch.FEW_PAIRS_PER_SM, H100 SMs
            key, table = f"head_dim={head_dim},few_programs={few}", run["table_after"]
            new = table.get(f"{key},scaled_cache=1", table.get(key))  # an fp8 cache's sweep
            label = f"N{new['BLOCK_N']} w{new['num_warps']} s{new['num_stages']}" + (
                f" r{new['maxnreg']}" if new.get("maxnreg") else ""
            )
            here = [r for r in rows if (r["batch"], r["context"]) == (batch, context)]
            before.append(next(r["us"] for r in here if r["heuristic_splits"]))
            after.append(next((r["us"] for r in here if r["config"] == label), before[-1]))
        x = range(len(shapes))
        ax.bar([i - 0.2 for i in x], before, 0.4, label="table before")
        ax.bar([i + 0.2 for i in x], after, 0.4, label="table after")
        ax.set_xticks(list(x), [f"{b}x{c}" for b, c in shapes], rotation=60, fontsize=7)
        ax.set(ylabel="µs per call", xlabel="batch x context", title=setup, yscale="log")
        ax.legend()
    return save_beside(fig, [run], path)


def plot_decode_splits(path: str) -> str:
    """Decode attention per batch shape at one split, at the heuristic's count and at the
    fastest count (`attention_kernels.py --sweep-splits`), one panel per setup."""
    run = load(path)[0]
    setups = list(dict.fromkeys(r["setup"] for r in run["rows"]))
    fig, axes = plt.subplots(1, len(setups), figsize=(6 * len(setups), 4.5), squeeze=False)
    for ax, setup in zip(axes[0], setups):
        rows = [r for r in run["rows"] if r["setup"] == setup]
        shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
        picks = {"1 split": [], "heuristic": [], "fastest": []}
        for shape in shapes:
            here = [r for r in rows if (r["batch"], r["context"]) == shape]
            picks["1 split"].append(next(r["us"] for r in here if r["splits"] == 1))
            picks["heuristic"].append(next(r["us"] for r in here if r["heuristic_splits"]))
            picks["fastest"].append(min(r["us"] for r in here))
        for i, (label, values) in enumerate(picks.items()):
            ax.bar([j + (i - 1) * 0.27 for j in range(len(shapes))], values, 0.27, label=label)
        ax.set_xticks(range(len(shapes)), [f"{b}x{c}" for b, c in shapes], rotation=45, fontsize=7)
        ax.set(ylabel="µs per call", xlabel="batch x context", title=setup)
        ax.legend(fontsize=7)
    return save_beside(fig, [run], path)


def plot_fp8_gemm_sweep(path: str) -> str:
    """FP8 projections per row count: the fastest W8A16 config, torch's scaled GEMM and the fastest
    Triton FP8 GEMM config (both on rows quantized beforehand), one panel per projection."""
    rows = [r for r in load(path) if "fp8_sweep" in r]
    names = list(dict.fromkeys(r["projection"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        picked = [r for r in rows if r["projection"] == name]
        x = range(len(picked))
        for i, (label, us) in enumerate(
            (
                ("W8A16", [r["sweep"]["best_us"] for r in picked]),
                ("scaled GEMM (CUTLASS)", [r["fp8_sweep"]["scaled_us"] for r in picked]),
                ("Triton FP8 GEMM", [r["fp8_sweep"]["best_us"] for r in picked]),
            )
        ):
            ax.bar([j + (i - 1) * 0.27 for j in x], us, 0.27, label=label)
        ax.set_xticks(list(x), [str(r["rows"]) for r in picked])
        n, k = picked[0]["n"], picked[0]["k"]
        ax.set(xlabel="rows", ylabel="µs per call", title=f"{name} ({n} x {k})")
    axes[0][0].legend(fontsize=7)
    return save_beside(fig, rows, path)


def plot_fp8_accumulation(path: str) -> str:
    """Torch's scaled GEMM per projection and row count, promoted against fast accumulation."""
    rows = load(path)
    names = list(dict.fromkeys(r["projection"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        picked = [r for r in rows if r["projection"] == name]
        x = range(len(picked))
        for i, mode in enumerate(("promoted", "fast")):
            ax.bar(
                [j + (i - 0.5) * 0.4 for j in x], [r[mode]["us"] for r in picked], 0.4, label=mode
            )
        ax.set_xticks(list(x), [str(r["rows"]) for r in picked])
        ax.set(
            xlabel="rows",
            ylabel="µs per call",
            title=f"{name} ({picked[0]['n']} x {picked[0]['k']})",
        )
    axes[0][0].legend(fontsize=7)
    return save_beside(fig, rows, path)


def plot_gguf_rows(path: str) -> str:
    """GGUF formats per projection against rows: the layer's kernel (`us`) and de-quantize +
    cuBLAS (`dequantize_us`), with bf16 cuBLAS."""
    rows = load(path)
    names = list(dict.fromkeys(r["projection"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        for fmt in dict.fromkeys(r["format"] for r in rows):
            picked = [r for r in rows if r["projection"] == name and r["format"] == fmt]
            (line,) = ax.plot(
                [r["rows"] for r in picked], [r["us"] for r in picked], "o-", label=fmt
            )
            tail = [r for r in picked if "dequantize_us" in r]
            if tail:
                x, us = [r["rows"] for r in tail], [r["dequantize_us"] for r in tail]
                ax.plot(x, us, "x--", color=line.get_color())
        n, k = picked[0]["n"], picked[0]["k"]
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="rows",
            ylabel="µs per call",
            title=f"{name} ({n} x {k})",
        )
    axes[0][0].legend(
        fontsize=7, title="solid: layer; dashed: de-quantize + cuBLAS", title_fontsize=6
    )
    return save_beside(fig, rows, path)


def plot_gguf_gemv(paths: list[str], out: str) -> str:
    """One-row GGUF projections (the best swept config where swept), one bar per result file,
    per format and projection."""
    runs = [[r for r in load(p) if r["rows"] == 1] for p in paths]
    formats = [f for f in dict.fromkeys(r["format"] for r in runs[0]) if f != "bf16"]
    names = list(dict.fromkeys(r["projection"] for r in runs[0]))
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.8), squeeze=False)
    width = 0.8 / len(runs)
    for ax, name in zip(axes[0], names):
        for i, run in enumerate(runs):
            picked = {r["format"]: r for r in run if r["projection"] == name}
            us = [picked[f].get("sweep", {}).get("best_us", picked[f]["us"]) for f in formats]
            label = f"{run[0]['commit']}" + (" (swept)" if "sweep" in picked[formats[0]] else "")
            ax.bar(
                [j + (i - (len(runs) - 1) / 2) * width for j in range(len(formats))],
                us,
                width,
                label=label,
            )
        bf16 = [
            r["us"]
            for run in runs
            for r in run
            if r["projection"] == name and r["format"] == "bf16"
        ]
        ax.axhline(min(bf16), color="k", linestyle="--", linewidth=0.8, label="bf16 cuBLAS")
        ax.set_xticks(range(len(formats)), [f.removeprefix("gguf_") for f in formats])
        ax.set(ylabel="µs per call, one row", title=name)
    axes[0][0].legend(fontsize=7)
    rows = [r for run in runs for r in run]
    fig.suptitle(
        f"{rows[0]['device']} · {rows[-1]['date'][:10]} · GGUF GEMV over blocks", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


KERNEL_PARTS = (
    ("projections", ("gemm", "nvjet", "splitkreduce")),
    ("decode attention", ("_decode_kernel",)),
    ("RMSNorm", ("rms_norm",)),
    ("rotary", ("rope",)),
    ("silu·mul", ("silu",)),
)


def kernel_part(name: str) -> str:
    lowered = name.lower()
    return next((part for part, keys in KERNEL_PARTS if any(k in lowered for k in keys)), "other")


def plot_profile_step(path: str) -> str:
    """One stacked bar a weight format: the eager forward's GPU time by kind of kernel, and the
    CUDA-graph replay beside it."""
    rows = load(path)
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.7 * len(rows)))
    parts = [part for part, _ in KERNEL_PARTS] + ["other"]
    labels = [model_label(r) + f", batch {r['batch']}" for r in rows]
    left = [0.0] * len(rows)
    for part in parts:
        widths = [
            sum(k["ms"] for k in r["top_kernels"] if kernel_part(k["kernel"]) == part) for r in rows
        ]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.scatter(
        [r["graph_replay_gpu_ms"] for r in rows],
        labels,
        marker="|",
        s=400,
        c="k",
        label="graph replay",
        zorder=3,
    )
    ax.set(xlabel="ms of GPU time per decode step", title="Where a decode step goes")
    ax.legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.4, -0.25))
    return save_beside(fig, rows, path)


def plot_int4_gemm_trial(path: str) -> str:
    """The 4-bit GEMM trial: the best time of each design per projection, and where the time of
    the warp-specialized kernels goes (parts left out in turn)."""
    (trial,) = load(path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    best = trial["best"]
    xs = range(len(best))
    for i, (key, label) in enumerate(
        [
            ("current_us", "Triton kernel (kept)"),
            ("streamed_us", "streamed, warp-specialized"),
            ("resident_us", "x resident, warp-specialized"),
        ]
    ):
        ax1.bar(
            [x + 0.27 * (i - 1) for x in xs],
            [r[key] / r["current_us"] for r in best],
            0.27,
            label=label,
        )
    ax1.set_xticks(list(xs), [r["projection"] for r in best])
    ax1.set(ylabel="time / Triton kernel's", title="4-bit GEMM at 64 rows, best config each")
    ax1.legend(fontsize=7)
    modes = trial["modes"]
    keys = ["full_us", "no_unpack_us", "no_mma_us", "loads_only_us"]
    for i, key in enumerate(keys):
        ax2.bar(
            [x + 0.2 * (i - 1.5) for x in range(len(modes))],
            [m[key] / m["current_us"] for m in modes],
            0.2,
            label=key[:-3].replace("_", " "),
        )
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks(
        range(len(modes)), [f"{m['design']}\n{m['projection']}" for m in modes], fontsize=7
    )
    ax2.set(ylabel="time / Triton kernel's", title="Parts left out (same kernel)")
    ax2.legend(fontsize=7)
    return save_beside(fig, [trial], path)


def save_beside(fig, rows: list[dict], path: str) -> str:
    """Title `fig` with the rows' device, date and commits, and save it as PNG beside `path`."""
    commits = ", ".join(dict.fromkeys(r["commit"] for r in rows))
    fig.suptitle(f"{rows[0]['device']} · {rows[0]['date'][:10]} · commit {commits}", fontsize=9)
    fig.tight_layout()
    out = path[: -len(".json")] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def model_label(r: dict) -> str:
    """The model, and its weight format where it is kept quantized."""
    quantization = r.get("quantization", "none")
    if r.get("quantize_lm_head"):
        quantization += " + lm_head"
    if r.get("fp8_fast_accumulation"):
        quantization += ", fast accumulation"
    label = r["model"] if quantization == "none" else f"{r['model']} ({quantization})"
    tp = r.get("tensor_parallel_size", 1)
    return label if tp == 1 else f"{label}, TP {tp}"


def plot_offline(paths: list[str], out: str) -> str:
    rows = [r for p in paths for r in load(p)]
    labels, values, colours = [], [], []
    for r in rows:
        lengths = f"ISL {'-'.join(map(str, r['isl']))}\nOSL {'-'.join(map(str, r['osl']))}"
        engine = f"batch {r['engine']['max_batch_size']}" if "engine" in r else ""
        if "max_seq_len" in r.get("engine", {}):
            engine += f"\nmax_seq_len {r['engine']['max_seq_len']}"
        if r.get("kv_cache_dtype", "auto") != "auto":
            engine += f", kv {r['kv_cache_dtype']}"
        label = f"{model_label(r)}\n{r['num_requests']} req, {engine}\n{lengths}\n{r['commit']}"
        repeats = sum(other.startswith(label) for other in labels)
        labels.append(label if not repeats else f"{label} (run {repeats + 1})")
        values.append(r["output_tokens_per_s"])
        colours.append("tab:blue")
        if "hf_output_tokens_per_s" in r:
            labels.append(f"{r['model']}\ntransformers")
            values.append(r["hf_output_tokens_per_s"])
            colours.append("tab:gray")
    fig, ax = plt.subplots(figsize=(max(8, 2.0 * len(values)), 4.8))
    bars = ax.bar(labels, values, color=colours)
    ax.bar_label(bars, fmt="%.0f")
    ax.set(ylabel="output tokens/s", title="Offline throughput")
    r0 = rows[0]
    commits = ", ".join(sorted({r["commit"] for r in rows}))
    fig.suptitle(f"engine (blue), transformers (gray) — {r0['device']}, {commits}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_side_by_side(path: str) -> str:
    """benchmarks/peer_vllm.py compare: ours over vLLM per row (above 1: ours ahead)."""
    result = json.load(open(path))
    rows = result["rows"]
    labels = [f"{r['measure']} {r['model']}\n{r['at'] or ''} {r['unit']}" for r in rows]
    # Higher is better for every bar: time per token is inverted.
    values = [
        r["vllm"] / r["ours"] if r["unit"] == "ms/token" else r["ours_over_vllm"] for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(rows)), 4.8))
    bars = ax.bar(labels, values, color=["tab:blue" if v >= 1 else "tab:red" for v in values])
    ax.bar_label(bars, fmt="%.2fx")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(ylabel="ours / vLLM (speed)", title="Side by side with vLLM, same GPU, same requests")
    sources = result["sources"][0]
    commits = ", ".join(sorted({str(s["commit"]) for s in result["sources"]}))
    fig.suptitle(f"{sources['device']}, {commits}", fontsize=8)
    fig.tight_layout()
    out = path.replace(".json", ".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_all_reduce(path: str) -> str:
    """Time of one all-reduce per size, through NCCL and through the peer-mapped buffer."""
    rows = load(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("nccl", "peer"):
        kept = [r for r in rows if f"{name}_us" in r]
        ax.plot([r["rows"] for r in kept], [r[f"{name}_us"] for r in kept], "o-", label=name)
    r0 = rows[0]
    ax.set(
        xscale="log",
        xlabel=f"rows of {r0['hidden']} {r0['dtype']}",
        ylabel="µs per all-reduce (in a CUDA graph)",
        title=f"All-reduce over {r0['gpus']} GPUs",
    )
    ax.legend()
    return save_beside(fig, rows, path)


def headline(results_dir: str) -> str:
    """Markdown table of every offline and decode-floor result."""
    lines = ["| benchmark | model | device | result | baseline / floor |", "|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        for r in load(path):
            if r.get("benchmark") == "offline":
                base = (
                    f"transformers {r['hf_output_tokens_per_s']:,.0f} tok/s ({r['speedup_vs_hf']}x)"
                    if "hf_output_tokens_per_s" in r
                    else "—"
                )
                lines.append(
                    f"| offline, {r['num_requests']} req, ISL {r['isl']}, OSL {r['osl']} "
                    f"| {model_label(r)} | {r['device']} "
                    f"| {r['output_tokens_per_s']:,.0f} output tok/s | {base} |"
                )
            elif r.get("benchmark") == "decode_floor" and "step_ms" in r:
                lines.append(
                    f"| decode step, batch {r['batch']}, ISL {r['isl']} | {r['model']} "
                    f"| {r['device']} | {r['step_ms']} ms | floor {r['floor_ms']} ms, "
                    f"fraction {r['fraction_of_floor']} |"
                )
    return "\n".join(lines)


def device_tag(device: str) -> str:
    """'cpu', or the GPU's model number: 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    if device.startswith("CPU"):
        return "cpu"
    model = re.search(r"\b[A-Z]+\d{2,4}\b", device)
    return model.group(0).lower() if model else re.sub(r"\W+", "_", device).strip("_").lower()


def main(argv: list[str] | None = None) -> None:
    results_dir = (argv or sys.argv[1:] or ["benchmarks/results"])[0]
    for path in glob.glob(os.path.join(results_dir, "decode_floor*.json")):
        print("wrote", plot_decode_floor(path))
    for model in ("llama1b", "llama8b"):
        paths = sorted(glob.glob(os.path.join(results_dir, f"decode_context*_{model}_h200.json")))
        if paths:  # in the order they ran
            paths.sort(key=lambda p: load(p)[0]["date"])
            out = os.path.join(results_dir, f"decode_context_{model}_h200.png")
            print("wrote", plot_decode_context(paths, out))
    for path in glob.glob(os.path.join(results_dir, "decode_attention_sweep*.json")):
        print("wrote", plot_attention_sweep(path))
    for path in glob.glob(os.path.join(results_dir, "decode_attention_splits*.json")):
        print("wrote", plot_decode_splits(path))
    for path in glob.glob(os.path.join(results_dir, "quantized_matmul_fp8*.json")):
        print("wrote", plot_fp8_gemm_sweep(path))
    gemv = ["gguf_gemv_before_96bc55c", "gguf_sweep_92d5559", "gguf_gemv_split_e4351ea"]
    paths = [os.path.join(results_dir, f"quantized_matmul_{name}_h100.json") for name in gemv]
    if all(os.path.exists(p) for p in paths):
        out = os.path.join(results_dir, "quantized_matmul_gguf_gemv_h100.png")
        print("wrote", plot_gguf_gemv(paths, out))
    for path in glob.glob(os.path.join(results_dir, "quantized_matmul_gguf*rows*.json")):
        print("wrote", plot_gguf_rows(path))
    for path in glob.glob(os.path.join(results_dir, "profile_step*.json")):
        print("wrote", plot_profile_step(path))
    for path in glob.glob(os.path.join(results_dir, "quantized_matmul_int4_gluon*.json")):
        print("wrote", plot_int4_gemm_trial(path))
    for path in glob.glob(os.path.join(results_dir, "fp8_accumulation*.json")):
        print("wrote", plot_fp8_accumulation(path))
    for path in glob.glob(os.path.join(results_dir, "all_reduce*.json")):
        print("wrote", plot_all_reduce(path))
    for pattern in ("decode_formats*.json", "decode_window*.json", "decode_tp*.json"):
        for path in glob.glob(os.path.join(results_dir, pattern)):
            if all("step_ms" in r for r in load(path)):  # not a summary of several runs
                print("wrote", plot_variants(path))
    groups: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(results_dir, "offline*.json")):
        groups.setdefault(load(path)[0]["device"], []).append(path)
    for device, paths in sorted(groups.items()):
        print(
            "wrote",
            plot_offline(
                sorted(paths), os.path.join(results_dir, f"offline_{device_tag(device)}.png")
            ),
        )
    print(headline(results_dir))


if __name__ == "__main__":
    main()

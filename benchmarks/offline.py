"""Offline throughput: N requests with random prompts, input/output lengths drawn uniformly from
ranges, fixed output lengths (the end id is ignored). All requests are submitted at once and the
executor batches them in flight. With `--baseline hf`, transformers `generate` serves the same
requests in static batches in the same run (optionally a stated subset, to bound its time).
Before the clock starts, the engine serves the same lengths once with other token ids (kernel
compilation, lazy module loading and cuBLAS's first calls on each shape stay out of the timing;
`--no-warmup` keeps them in).

    python -m benchmarks.offline --model llama-3.2-1b --num-requests 256 --isl 100:1024 \
        --osl 100:1024 --seed 0 --baseline hf --json benchmarks/results/offline_llama1b_h100.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.loading.model_paths import resolve_model
from backend.sampling_params import SamplingParams
from benchmarks.provenance import provenance, save_json
from benchmarks.weight_format_options import (
    add_kv_cache_dtype_option,
    add_weight_format_options,
    weight_format_fields,
)


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def random_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def make_requests(num: int, isl: tuple[int, int], osl: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(num):
        prompts.append(random_ids(rng, rng.randint(*isl), vocab))
        lengths.append(rng.randint(*osl))
    return prompts, lengths


def same_lengths_other_ids(prompts, vocab: int, seed: int):
    rng = random.Random(seed)
    return [random_ids(rng, len(p), vocab) for p in prompts]


def run_engine(executor: Executor, prompts, lengths) -> float:
    params = [SamplingParams(max_tokens=n, ignore_end_id=True) for n in lengths]
    start = time.perf_counter()
    results = executor.generate(prompts, params)
    _sync(executor.runner.device)
    wall = time.perf_counter() - start
    produced = [len(r["token_ids"]) for r in results]
    assert produced == lengths, "the engine must produce exactly the requested output lengths"
    return wall


@torch.inference_mode()
def run_hf(model_dir: str, device, dtype, prompts, lengths, batch_size: int) -> float:
    """transformers generate, static batches (left padding), exact lengths via min/max_new_tokens.
    Tokens beyond a request's own length are generated but not counted."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from backend.loading.presets import random_weights_spec

    if random_weights_spec(model_dir) is not None:  # a preset: random weights, speed is what counts
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding: fairer to HF
    warm = torch.tensor([prompts[order[0]]] * min(batch_size, len(prompts)), device=device)
    model.generate(
        input_ids=warm, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
    )
    _sync(device)
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new = max(lengths[i] for i in idx)
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    _sync(device)
    return time.perf_counter() - start


def profile_run(executor: Executor, prompts, lengths, top: int = 12) -> dict:
    """The same run again, with its steps counted by kind and its GPU kernels timed by name
    (torch.profiler, CUDA activity only): where the wall time goes."""
    from torch.profiler import ProfilerActivity, profile

    steps = {"prefill_only": 0, "mixed": 0, "decode_only": 0}
    decode_batch = {"1-16": 0, "17-64": 0, "65-128": 0, "129+": 0}
    step = executor.engine.step

    def counting_step():
        batch = step()
        if batch is None:
            return batch
        decodes = sum(1 for c in batch.chunks if c.num_tokens == 1)
        kind = (
            "decode_only"
            if decodes == len(batch.chunks)
            else "prefill_only"
            if not decodes
            else "mixed"
        )
        steps[kind] += 1
        if kind == "decode_only":
            n = len(batch.chunks)
            decode_batch[
                "1-16" if n <= 16 else "17-64" if n <= 64 else "65-128" if n <= 128 else "129+"
            ] += 1
        return batch

    executor.engine.step = counting_step
    try:
        if executor.runner.device.type != "cuda":  # no kernel timings on CPU
            return {
                "profiled_wall_s": round(run_engine(executor, prompts, lengths), 3),
                "steps": steps,
                "decode_steps_by_batch": decode_batch,
            }
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = run_engine(executor, prompts, lengths)
    finally:
        executor.engine.step = step
    rows = [
        (e.key, e.count, getattr(e, "self_device_time_total", 0.0)) for e in prof.key_averages()
    ]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    busy_s = sum(r[2] for r in rows) / 1e6
    return {
        "profiled_wall_s": round(wall, 3),
        "gpu_busy_s": round(busy_s, 3),
        "gpu_busy_fraction": round(busy_s / wall, 3),
        "steps": steps,
        "decode_steps_by_batch": decode_batch,
        "top_kernels": [
            {
                "kernel": k[:80],
                "count": c,
                "s": round(t / 1e6, 3),
                "share": round(t / 1e6 / busy_s, 3),
            }
            for k, c, t in rows[:top]
        ],
    }


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.offline", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--model",
        default="default",
        help="'default', a preset (llama-3.2-1b, llama-3.1-8b), a HF dir",
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--isl", type=parse_range, default=(100, 1024), help="input lengths A:B (uniform)"
    )
    p.add_argument(
        "--osl", type=parse_range, default=(100, 1024), help="output lengths A:B (uniform)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument(
        "--hf-requests", type=int, default=None, help="serve only the first K requests with HF"
    )
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    add_weight_format_options(p)
    add_kv_cache_dtype_option(p)
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs the model is split across"
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="time the first pass (compiles included)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="run once more under torch.profiler: steps by kind, GPU busy time, top kernels",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="pin max_seq_len (default: the server's, the model's context)",
    )
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)

    if args.max_seq_len is not None and args.max_seq_len < args.isl[1] + args.osl[1]:
        p.error(f"--max-seq-len {args.max_seq_len} is shorter than the longest request")
    config = EngineConfig(
        model_path=args.model,
        **weight_format_fields(args),
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    executor = Executor(config)
    prompts, lengths = make_requests(
        args.num_requests, args.isl, args.osl, executor.vocab_size, args.seed
    )
    # Warm-up: the whole workload once with other token ids (same lengths, so prefix reuse cannot
    # serve the measured prompts): every kernel variant the run meets is compiled and loaded, and
    # cuBLAS has seen every GEMM shape, before the clock starts.
    if not args.no_warmup:
        run_engine(
            executor, same_lengths_other_ids(prompts, executor.vocab_size, args.seed + 1), lengths
        )
    wall = run_engine(executor, prompts, lengths)
    result = {
        "benchmark": "offline",
        **provenance(executor.runner.device),
        "model": args.model,
        "dtype": str(executor.runner.dtype).replace("torch.", ""),
        **weight_format_fields(args),
        "kv_cache_dtype": args.kv_cache_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "weight_bytes": executor.runner.weight_bytes,
        "num_requests": args.num_requests,
        "isl": list(args.isl),
        "osl": list(args.osl),
        "seed": args.seed,
        "total_input_tokens": sum(map(len, prompts)),
        "total_output_tokens": sum(lengths),
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(sum(lengths) / wall, 1),
        "warmup": "none" if args.no_warmup else "the same lengths once with other token ids",
        "engine": {
            "max_batch_size": args.max_batch_size,
            "max_num_tokens": args.max_num_tokens,
            "max_seq_len": executor.max_seq_len,
            "max_seq_len_pinned": args.max_seq_len is not None,
            "kv_blocks": executor.runner.num_kv_blocks,
            "tokens_per_block": executor.runner.tokens_per_block,
            "preemptions": executor.stats().num_preemptions,
        },
    }
    if args.profile:  # other token ids again: no prefix reuse from the timed run
        result["profile"] = profile_run(
            executor, same_lengths_other_ids(prompts, executor.vocab_size, args.seed + 2), lengths
        )
    device, dtype = executor.runner.device, executor.runner.dtype
    executor.shutdown()  # frees the engine's GPU memory for the transformers baseline
    del executor
    if args.baseline == "hf":
        k = min(args.hf_requests or args.num_requests, args.num_requests)
        model_dir = resolve_model(args.model)  # transformers reads the de-quantized checkpoint
        hf_wall = run_hf(model_dir, device, dtype, prompts[:k], lengths[:k], args.hf_batch_size)
        result.update(
            hf_requests=k,
            hf_batch_size=args.hf_batch_size,
            hf_wall_s=round(hf_wall, 3),
            hf_output_tokens_per_s=round(sum(lengths[:k]) / hf_wall, 1),
        )
        result["speedup_vs_hf"] = round(
            result["output_tokens_per_s"] / result["hf_output_tokens_per_s"], 2
        )
    print(json.dumps(result, indent=2))
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

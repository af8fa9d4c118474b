"""Decode step time against the memory floor.

A decode step must at least read every weight once and every sequence's KV cache once, and write
the new tokens' K/V. The floor is that byte count at the device-to-device copy rate measured in the
same run (a copy reads and writes, so its rate counts both). `fraction_of_floor` = floor / step:
1.0 would mean the step runs at copy speed.

The step time is measured through the whole engine (scheduler, runner, sampler, delivery) by
difference: B requests of `--isl` prompt tokens generate N1 and then N2 tokens; the extra
N2 - N1 decode steps take (wall2 - wall1), so prefill and start-up cancel out.

    python -m benchmarks.decode_floor --model llama-3.2-1b --batch 1 64 --isl 128 4096 --json OUT

By default the engine runs at the server's settings: `max_seq_len` is the model's context and the
KV pool takes `kv_cache_free_gpu_mem_fraction` of free memory; `--max-seq-len` and
`--kv-cache-tokens` pin them (the result says so). A (batch, context) that does not fit the pool
is recorded as skipped.

`--quantization` reads the weights in that format (a preset's random weights: a format quantized at
load, int8_wo, int4_wo or fp8; `--quantize-lm-head`: the lm_head too); the floor then counts the
bytes the format stores, and of an embedding table the lm_head does not share only the rows. With
`--max-attention-window W` each sequence's KV read is its last W tokens; `--kv-cache-dtype fp8|int8`
reads a quantized cache (values and scales counted). `--tensor-parallel-size N` splits the model
over N GPUs; the floor is then one rank's: its shard of the weights and of the KV heads, read by
every GPU at the same time.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.layers.embedding import Embedding
from backend.quantization import QuantizedWeight
from backend.sampling_params import SamplingParams
from benchmarks.provenance import provenance, save_json
from benchmarks.weight_format_options import (
    add_kv_cache_dtype_option,
    add_weight_format_options,
    weight_format_fields,
)


def copy_rate_bytes_per_s(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: torch.nn.Module) -> int:
    """Every weight a decode step reads, once: the parameters and quantized weights (a tied
    embedding/lm_head matrix once), less an embedding table the lm_head does not read (a lookup
    reads only the step's rows: an untied model's, or a tied one whose head is quantized)."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    lookups = {
        m.weight.data_ptr()
        for m in model.modules()
        if isinstance(m, Embedding) and m.weight is not None and m.weight is not head
    }
    seen, total = set(lookups), 0
    quantized = [b for m in model.modules() if isinstance(m, QuantizedWeight) for b in m.buffers()]
    for p in [*model.parameters(), *quantized]:
        if p.numel() and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(runner) -> int:
    return runner.kv_block_bytes() // runner.tokens_per_block


def timed_generate(executor: Executor, prompts, max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_end_id=True)
    start = time.perf_counter()
    executor.generate(prompts, params)
    return time.perf_counter() - start


def measure(
    executor: Executor, batch: int, isl: int, n1: int, n2: int, repeats: int, window: int | None
) -> dict:
    rng = random.Random(0)
    # Distinct prompts: prefix reuse must not shrink the work.
    prompts = [
        [rng.randrange(100, executor.vocab_size - 100) for _ in range(isl)] for _ in range(batch)
    ]
    timed_generate(executor, prompts, n1)  # warm-up: compile kernels, capture graphs
    diffs = []
    for _ in range(repeats):
        short = timed_generate(executor, prompts, n1)
        long = timed_generate(executor, prompts, n2)
        diffs.append((long - short) / (n2 - n1))
    diffs.sort()
    step_s = diffs[len(diffs) // 2]
    runner = executor.runner
    mean_context = isl + (n1 + n2) / 2
    kv_read = batch * min(mean_context, window or mean_context) * kv_bytes_per_token(runner)
    kv_write = batch * kv_bytes_per_token(runner)
    logits = batch * runner.vocab_size * 4
    total = weight_bytes(runner.model) + kv_read + kv_write + logits
    return {
        "step_ms": round(step_s * 1e3, 4),
        "step_ms_all": [round(d * 1e3, 4) for d in diffs],
        "bytes_per_step": int(total),
        "weight_bytes": weight_bytes(runner.model),
        "kv_bytes_read": int(kv_read),
        "mean_context": mean_context,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_floor", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--isl", type=int, nargs="+", default=[128], help="prompt lengths (contexts)")
    p.add_argument("--n1", type=int, default=16)
    p.add_argument("--n2", type=int, default=144)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    add_weight_format_options(p)
    p.add_argument("--max-attention-window", type=int, default=None)
    add_kv_cache_dtype_option(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="no decode CUDA graphs")
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="pin max_seq_len (default: the server's, the model's context)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="pin the KV pool (default: the server's, a fraction of free memory)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    max_batch = max(args.batch)
    budget = max(2048, min(max_batch * max(args.isl), 16384))
    config = EngineConfig(
        model_path=args.model,
        **weight_format_fields(args),
        kv_cache_dtype=args.kv_cache_dtype,
        max_attention_window_size=(
            None if args.max_attention_window is None else str(args.max_attention_window)
        ),
        device=args.device,
        dtype=args.dtype,
        max_batch_size=max_batch,
        max_num_tokens=budget,
        max_seq_len=args.max_seq_len,
        max_tokens_in_paged_kv_cache=args.kv_cache_tokens,
        # The prompts are prefilled once (the warm-up); the timed runs reuse their blocks.
        enable_kv_cache_reuse=True,
        tensor_parallel_size=args.tensor_parallel_size,
        cuda_graphs=not args.eager,
    )
    executor = Executor(config)
    device = executor.runner.device
    rate = copy_rate_bytes_per_s(device)
    pool_tokens = executor.runner.num_kv_blocks * executor.runner.tokens_per_block
    max_seq_len = executor.max_seq_len
    results = []
    for isl in args.isl:
        for batch in args.batch:
            common = {
                "benchmark": "decode_floor",
                **provenance(device),
                "model": args.model,
                "dtype": str(executor.runner.dtype).replace("torch.", ""),
                **weight_format_fields(args),
                "kv_cache_dtype": args.kv_cache_dtype,
                "tensor_parallel_size": args.tensor_parallel_size,
                "max_seq_len": max_seq_len,
                "max_seq_len_pinned": args.max_seq_len is not None,
                "kv_blocks": executor.runner.num_kv_blocks,
                "kv_pool_pinned": args.kv_cache_tokens is not None,
                "max_attention_window_size": args.max_attention_window,
                "batch": batch,
                "isl": isl,
                "cuda_graphs": executor.config.cuda_graphs,
            }
            seq = isl + args.n2 + 1
            held = seq if args.max_attention_window is None else min(seq, args.max_attention_window)
            if seq > max_seq_len or batch * (held + executor.runner.tokens_per_block) > pool_tokens:
                results.append({**common, "skipped": f"does not fit ({pool_tokens} pool tokens)"})
                print(json.dumps(results[-1]), flush=True)
                continue
            r = measure(
                executor, batch, isl, args.n1, args.n2, args.repeats, args.max_attention_window
            )
            floor_s = r["bytes_per_step"] / rate
            results.append(
                {
                    **common,
                    **r,
                    "copy_rate_tb_s": round(rate / 1e12, 3),
                    "floor_ms": round(floor_s * 1e3, 4),
                    "fraction_of_floor": round(floor_s * 1e3 / r["step_ms"], 3),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    executor.shutdown()
    save_json(args.json, results if len(results) > 1 else results[0])
    return results


if __name__ == "__main__":
    main()

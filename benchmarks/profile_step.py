"""Where a decode step's time goes, on GPU: the CUDA-graph replay alone (GPU time), the runner
(packing + copies + replay + reading the sampled ids), and the per-kernel GPU time of one eager
forward. Compare with `benchmarks.decode_floor`'s engine step (which adds scheduling, sampling
and delivery).

    python -m benchmarks.profile_step --model llama-3.2-1b --batch 1 --isl 128 --json OUT
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from backend.config import EngineConfig
from backend.request import Chunk
from backend.runner.model_runner import ModelRunner
from benchmarks.provenance import provenance, save_json
from benchmarks.weight_format_options import add_weight_format_options, weight_format_fields


def cuda_ms(fn, repeats: int = 100) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def wall_ms(fn, repeats: int = 100) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / repeats


def kernel_table(step, top: int = 15) -> dict:
    """The CUDA kernels that one call of `step` runs (graph replays included): their summed
    time, launches and the `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    rows = [
        e
        for e in prof.key_averages()
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)
    ]
    rows = [(e.key, e.count, getattr(e, "self_device_time_total", 0.0)) for e in rows]
    rows = [r for r in rows if r[2] > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    return {
        "eager_gpu_ms": round(total / 1e3, 4),
        "eager_kernel_launches": sum(r[1] for r in rows),
        "top_kernels": [
            {"kernel": k[:90], "count": c, "ms": round(t / 1e3, 4), "share": round(t / total, 3)}
            for k, c, t in rows[:top]
        ],
    }


def engine_profile(
    model: str,
    batch: int,
    isl: int,
    steps: int = 64,
    top: int = 20,
    tensor_parallel_size: int = 1,
    max_seq_len: int | None = None,
) -> dict:
    """The whole engine under torch.profiler for `steps` decode steps: how busy the GPU (rank
    0's) is, its kernels, and the host functions that take the time between kernels."""
    from torch.profiler import ProfilerActivity, profile

    from backend.engine.executor import Executor
    from backend.sampling_params import SamplingParams

    executor = Executor(
        EngineConfig(
            model_path=model,
            max_batch_size=batch,
            max_seq_len=max_seq_len or isl + steps + 32,
            max_tokens_in_paged_kv_cache=batch * (isl + steps + 64),
            max_num_tokens=max(2048, min(batch * isl, 16384)),
            tensor_parallel_size=tensor_parallel_size,
        )
    )
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, executor.vocab_size - 100) for _ in range(isl)] for _ in range(batch)
    ]
    params = SamplingParams(max_tokens=steps, ignore_end_id=True)
    executor.generate(prompts, SamplingParams(max_tokens=8, ignore_end_id=True))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        executor.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    executor.shutdown()
    events = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    cpu_rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    kernels = sorted(
        (e for e in events if getattr(e, "self_device_time_total", 0.0) > 0),
        key=lambda e: -e.self_device_time_total,
    )[:top]
    return {
        "engine_wall_ms": round(wall * 1e3, 2),
        "steps": steps,
        "gpu_busy_ms": round(gpu_us / 1e3, 2),
        "gpu_busy_fraction": round(gpu_us / 1e6 / wall, 3),
        "top_host_ops": [
            {
                "op": e.key[:80],
                "count": e.count,
                "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
            }
            for e in cpu_rows
        ],
        "top_kernels": [
            {
                "kernel": e.key[:90],
                "count": e.count,
                "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 4),
            }
            for e in kernels
        ],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_step", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--isl", type=int, default=128)
    add_weight_format_options(p, help="weight format (runner profile)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--engine", action="store_true", help="profile the whole engine instead of the runner"
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="with --engine")
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="the engine's max_seq_len (default: the prompt and the profiled steps)",
    )
    args = p.parse_args(argv)
    if args.engine:
        results = [
            {
                "benchmark": "profile_engine",
                "model": args.model,
                "batch": b,
                "isl": args.isl,
                "tensor_parallel_size": args.tensor_parallel_size,
                "max_seq_len": args.max_seq_len,
                **engine_profile(
                    args.model,
                    b,
                    args.isl,
                    tensor_parallel_size=args.tensor_parallel_size,
                    max_seq_len=args.max_seq_len,
                ),
            }
            for b in args.batch
        ]
        print(json.dumps(results, indent=1), flush=True)
        save_json(args.json, results)
        return results
    max_batch = max(args.batch)
    seq = args.isl + 64
    runner = ModelRunner(
        EngineConfig(
            model_path=args.model,
            max_batch_size=max_batch,
            max_seq_len=args.max_seq_len or seq,
            max_tokens_in_paged_kv_cache=max_batch * seq,
            **weight_format_fields(args),
        )
    )
    rng = random.Random(0)
    per_seq = -(-seq // runner.tokens_per_block)
    results = []
    for batch in args.batch:
        blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        prompts = [
            [rng.randrange(100, runner.vocab_size - 100) for _ in range(args.isl)]
            for _ in range(batch)
        ]
        runner.execute([Chunk.of_sequence(p, b) for p, b in zip(prompts, blocks)])
        decode = [Chunk.of_sequence(p + [5], b, args.isl) for p, b in zip(prompts, blocks)]
        inputs = runner.prepare(decode)
        graphs = runner.decode_graphs
        row = {
            "benchmark": "profile_step",
            **provenance(runner.device),
            "model": args.model,
            "batch": batch,
            "isl": args.isl,
            **weight_format_fields(args),
        }
        if graphs is not None:  # staged each time: a replay reads the slot staged for it
            row["graph_replay_gpu_ms"] = round(
                cuda_ms(lambda: (runner.prepare(decode), graphs.replay(batch))), 4
            )
        row["runner_step_ms"] = round(
            wall_ms(lambda: runner.execute(decode).logits.argmax(-1).tolist()), 4
        )
        row["prepare_ms"] = round(wall_ms(lambda: runner.prepare(decode)), 4)
        row.update(kernel_table(lambda: runner.model.compute_logits(runner.run_model(inputs))))
        results.append(row)
        print(json.dumps(row, indent=1), flush=True)
    save_json(args.json, results)
    return results


if __name__ == "__main__":
    main()

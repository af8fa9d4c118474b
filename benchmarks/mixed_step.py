"""What a step with prompt chunks costs next to a decode step, at the runner: the host time to
queue it, its wall time with the sampled ids read back, the host functions that take that
host time (cProfile, own time) and, on GPU, its kernels' summed time (torch.profiler). Steps:
B decode rows alone, then B - k decode rows beside k new prompts of --isl tokens, and the k
prompts alone. On GPU a decode-only step runs in its CUDA graph; a step with prompt tokens
replays a mixed-step graph up to --cuda-graph-max-tokens tokens (0: eagerly), so comparing the
two shows the eager path's cost.

    python -m benchmarks.mixed_step --model llama-3.2-1b --batch 64 --isl 336 --json OUT
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.request import Chunk
from backend.runner.model_runner import ModelRunner
from benchmarks.profile_step import kernel_table
from benchmarks.provenance import provenance, save_json


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn, each call started on an idle device."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    _sync(device)
    return round(statistics.median(times), 3)


def host_ops(runner: ModelRunner, chunks: list[Chunk], top: int) -> list[dict]:
    """The host functions of one step by their own time (cProfile: Python functions, kernel
    launchers included, and the C functions they call)."""
    profiler = cProfile.Profile()
    profiler.enable()
    runner.execute(chunks)
    profiler.disable()
    _sync(runner.device)
    entries = pstats.Stats(profiler).stats.items()  # (file, line, name) -> (cc, calls, tt, ct, _)
    ranked = sorted(entries, key=lambda item: -item[1][2])[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})" if line else name,
            "calls": calls,
            "own_ms": round(own * 1e3, 3),
            "cumulative_ms": round(cumulative * 1e3, 3),
        }
        for (file, line, name), (_, calls, own, cumulative, _) in ranked
    ]


def profile_steps(
    runner: ModelRunner, batch: int, isl: int, new_prompts: list[int], repeats: int, top: int
) -> dict:
    """One row per step kind (see the module docstring); sequences of isl random tokens."""
    per_seq = -(-(isl + 8) // runner.tokens_per_block)
    total = batch + max(new_prompts, default=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, runner.vocab_size - 5) for _ in range(isl)] for _ in range(total)]
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(total)]
    for i in range(0, batch, 8):  # the decode rows' prompts are in the cache
        end = min(i + 8, batch)
        runner.execute([Chunk.of_sequence(prompts[j], blocks[j]) for j in range(i, end)])
    _sync(runner.device)

    def decodes(n: int) -> list[Chunk]:
        return [Chunk.of_sequence(p + [5], b, isl) for p, b in zip(prompts[:n], blocks[:n])]

    def fresh(k: int) -> list[Chunk]:
        return [Chunk.of_sequence(prompts[batch + j], blocks[batch + j]) for j in range(k)]

    steps = {f"{batch} decodes": decodes(batch)}
    for k in new_prompts:
        prompts_k = f"{k} prompt" + ("s" if k > 1 else "")
        steps[f"{batch - k} decodes + {prompts_k}"] = decodes(batch - k) + fresh(k)
        steps[prompts_k] = fresh(k)
    rows = []
    for name, chunks in steps.items():
        row = {
            "step": name,
            "tokens": sum(c.num_tokens for c in chunks),
            "host_queue_ms": _median_ms(lambda: runner.execute(chunks), runner.device, repeats),
            "wall_ms": _median_ms(
                lambda: runner.execute(chunks).logits.argmax(-1).tolist(), runner.device, repeats
            ),
            "top_host_ops": host_ops(runner, chunks, top),
        }
        if runner.device.type == "cuda":  # what the GPU itself spends, graph replays included
            row["kernels"] = kernel_table(lambda: runner.execute(chunks), top=5)
        rows.append(row)
        print(f"{name:>28}: {row['tokens']:6d} tokens, queued in {row['host_queue_ms']:.3f} ms, "
              f"{row['wall_ms']:.3f} ms with the ids read back", flush=True)  # fmt: skip
    return {"steps": rows}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.mixed_step", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=64, help="decode rows of the decode-only step")
    p.add_argument("--isl", type=int, default=336, help="tokens of every prompt")
    p.add_argument("--prompts", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=EngineConfig.cuda_graph_max_tokens,
        help="steps with prompt tokens up to this many replay CUDA graphs (0: all eager)",
    )
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--top", type=int, default=15, help="host operations listed per step")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    seq = args.isl + 8
    runner = ModelRunner(
        EngineConfig(
            model_path=args.model,
            device=args.device,
            max_batch_size=args.batch,
            max_seq_len=seq,
            max_tokens_in_paged_kv_cache=(args.batch + max(args.prompts)) * (seq + 32),
            max_num_tokens=max(8192, max(args.prompts) * args.isl + args.batch),
            cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        )
    )
    result = {
        "benchmark": "mixed_step",
        **provenance(runner.device),
        "model": args.model,
        "batch": args.batch,
        "isl": args.isl,
        "cuda_graph_max_tokens": args.cuda_graph_max_tokens,
        **profile_steps(runner, args.batch, args.isl, args.prompts, args.repeats, args.top),
    }
    save_json(args.json, result)
    if not args.json:
        print(json.dumps(result["steps"][1]["top_host_ops"], indent=1))
    return result


if __name__ == "__main__":
    main()

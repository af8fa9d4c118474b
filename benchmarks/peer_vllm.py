"""Side by side with vLLM on the same GPU: the same requests to vLLM and to this engine.

Three measurements, each run for one engine per process (`--engine ours|vllm`) so that each has
the GPU to itself, both at their own defaults (vLLM: `max_model_len` = the model's context, KV
cache from `gpu_memory_utilization`, torch.compile and CUDA graphs; ours: the server's defaults).
Both load the same random-weight preset (vLLM with `load_format="dummy"`: same shapes, its own
random values, which cost the same).

- `offline`: N requests of random token ids, lengths uniform in ranges, exact output lengths,
  submitted at once after a warm-up pass over the same lengths (the requests of
  benchmarks/offline.py, same seed): output tokens/s.
- `itl`: batch 1, one prompt of each context length: generating 1 token and 1 + N tokens from
  prompts of that length (other random ids each time, so no prefix is reused), the difference
  over N is the time per output token at that context (median of `--repeats`).
- `serve` (`--engine vllm`): vLLM's OpenAI server, streamed `/v1/completions` from the client
  processes of benchmarks/serving.py at each concurrency, same prompts as its runs: tokens/s,
  TTFT, the gaps between events. Ours comes from `benchmarks.serving --targets openai:http ...`
  in the same call.

    python -m benchmarks.peer_vllm offline --engine vllm --model llama-3.2-1b --json v.json
    python -m benchmarks.peer_vllm itl --engine ours --model llama-3.2-1b --contexts 128 4096
    python -m benchmarks.peer_vllm compare --json side_by_side.json a.json b.json ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from benchmarks.offline import make_requests, parse_range, same_lengths_other_ids
from benchmarks.provenance import save_json


def preset_dir(model: str, tokenizer: str | None = None) -> str:
    from backend.loading.disk_cache import cache_root
    from backend.loading.presets import PRESETS, write_preset

    if model not in PRESETS:
        raise SystemExit(f"--model must be a preset ({', '.join(PRESETS)}), got {model!r}")
    return write_preset(model, cache_root(), tokenizer_from=tokenizer)


def vocab_of(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


# ---- the two engines behind one interface: generate(prompts, lengths) -> wall seconds ---------
class Vllm:
    def __init__(self, model_dir: str, seed: int):
        from vllm import LLM

        self.llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, seed=seed)
        config = self.llm.llm_engine.vllm_config
        self.settings = {
            "max_model_len": config.model_config.max_model_len,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "dtype": str(config.model_config.dtype),
        }

    def generate(self, prompts, lengths) -> float:
        from vllm import SamplingParams, TokensPrompt

        params = [
            SamplingParams(
                max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False
            )
            for n in lengths
        ]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
        produced = [len(o.outputs[0].token_ids) for o in outs]
        assert produced == list(lengths), "vLLM must produce exactly the requested lengths"
        return wall


class Ours:
    def __init__(self, model_dir: str, seed: int, **overrides):
        from backend.config import EngineConfig
        from backend.engine.executor import Executor

        self.executor = Executor(EngineConfig(model_path=model_dir, **overrides))
        runner = self.executor.runner
        self.settings = {
            "max_seq_len": self.executor.max_seq_len,
            "max_batch_size": self.executor.config.max_batch_size,
            "max_num_tokens": self.executor.config.max_num_tokens,
            "kv_blocks": runner.num_kv_blocks,
            "tokens_per_block": runner.tokens_per_block,
            "dtype": str(runner.dtype),
        }

    def generate(self, prompts, lengths) -> float:
        from benchmarks.offline import run_engine

        return run_engine(self.executor, prompts, lengths)


def load_engine(name: str, model_dir: str, seed: int, **overrides):
    return Vllm(model_dir, seed) if name == "vllm" else Ours(model_dir, seed, **overrides)


def versions(engine: str) -> dict:
    import torch
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__}
    if engine == "vllm":
        import vllm

        out["vllm"] = vllm.__version__
    return out


# ---- measurements ------------------------------------------------------------------------------
def measure_offline(engine, args, vocab: int) -> dict:
    prompts, lengths = make_requests(args.num_requests, args.isl, args.osl, vocab, args.seed)
    engine.generate(same_lengths_other_ids(prompts, vocab, args.seed + 1), lengths)
    wall = engine.generate(prompts, lengths)
    return {
        "num_requests": args.num_requests,
        "isl": list(args.isl),
        "osl": list(args.osl),
        "seed": args.seed,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(sum(lengths) / wall, 1),
    }


def measure_itl(engine, args, vocab: int) -> dict:
    import random

    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    rows = []
    for ctx in args.contexts:
        engine.generate([prompt(ctx)], [args.tokens + 1])  # warm-up at this length
        per_token = []
        for _ in range(args.repeats):
            one = engine.generate([prompt(ctx)], [1])
            many = engine.generate([prompt(ctx)], [args.tokens + 1])
            per_token.append((many - one) / args.tokens * 1e3)
        rows.append(
            {
                "context": ctx,
                "ms_per_token": round(statistics.median(per_token), 4),
                "samples_ms": [round(x, 4) for x in per_token],
            }
        )
        print(f"context {ctx}: {rows[-1]['ms_per_token']:.3f} ms/token", flush=True)
    return {"tokens": args.tokens, "repeats": args.repeats, "rows": rows}


def measure_serve(args, result: dict) -> dict:
    """vLLM's OpenAI server under the closed loop of benchmarks/serving.py."""
    from benchmarks.serving import make_requests as serving_requests
    from benchmarks.serving_load import Target, run_clients, summarize
    from ensemble.server import free_port
    from preprocessing.tokenizer import load_tokenizer

    model_dir = preset_dir(args.model, args.tokenizer)
    tokenizer = load_tokenizer(model_dir)
    port, name = free_port(), args.model
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir]
    cmd += ["--load-format", "dummy", "--port", str(port), "--served-model-name", name]
    cmd += ["--seed", str(args.seed)]
    log = open(args.server_log or os.devnull, "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://localhost:{port}/health", server, timeout_s=900)
        rows = []
        for c in args.concurrency:
            n = min(args.num_requests, max(args.min_requests, 8 * c))
            isl, osl = parse_range(args.isl_text), parse_range(args.osl_text)
            load = serving_requests(tokenizer, n, isl, osl, args.seed)
            target = Target("openai", name, f"localhost:{port}", "min_tokens")
            run_clients(target, load[: min(n, 2 * c)], c, args.processes)  # warm-up
            records = run_clients(target, load, c, args.processes)
            row = {"target": "vllm:openai", "concurrency": c, **summarize(records, load)}
            rows.append(row)
            if args.json:  # each level as it ends: a run cut short keeps what it measured
                save_json(args.json, {**result, "isl": args.isl_text, "runs": rows})
            print(
                f"vllm c={c}: {row['output_tokens_per_s']:.0f} tok/s, ttft p50 "
                f"{row['ttft_ms'].get('p50', 0):.1f} ms, gap p99 "
                f"{row['event_gap_ms'].get('p99', 0):.1f} ms",
                flush=True,
            )
        return {"isl": args.isl_text, "osl": args.osl_text, "runs": rows}
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {server.returncode} (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the vLLM server was not healthy within {timeout_s:.0f} s")


# ---- the table -----------------------------------------------------------------------------------
def compare(paths: list[str]) -> dict:
    """Rows of the side-by-side table from result files of both engines (and benchmarks.serving
    results for ours): ours / vLLM per row."""
    results = [json.load(open(p)) for p in paths]
    table = []
    by = {}
    for r in results:
        if r.get("benchmark") == "serving":  # ours, through benchmarks/serving.py
            for run in r["runs"]:
                if run["target"] == "openai:http":
                    by[("serve", r["model"], run["concurrency"], "ours")] = run
        elif r.get("measure") == "offline":
            by[("offline", r["model"], 0, r["engine"])] = r
        elif r.get("measure") == "itl":
            for row in r["rows"]:
                by[("itl", r["model"], row["context"], r["engine"])] = row
        elif r.get("measure") == "serve":
            for run in r["runs"]:
                by[("serve", r["model"], run["concurrency"], "vllm")] = run
    keys = sorted({k[:3] for k in by})
    for kind, model, at in keys:
        ours, theirs = by.get((kind, model, at, "ours")), by.get((kind, model, at, "vllm"))
        if ours is None or theirs is None:
            continue
        if kind == "itl":  # lower is better
            a, b, unit = ours["ms_per_token"], theirs["ms_per_token"], "ms/token"
            ahead = a < b
        else:
            a, b, unit = ours["output_tokens_per_s"], theirs["output_tokens_per_s"], "tok/s"
            ahead = a > b
        row = {"measure": kind, "model": model, "at": at, "unit": unit, "ours": a, "vllm": b}
        row["ours_over_vllm"] = round(a / b, 3)
        row["ahead"] = ahead
        if kind == "serve":
            for who, run in (("ours", ours), ("vllm", theirs)):
                row[f"{who}_ttft_p50_ms"] = round(run["ttft_ms"].get("p50", 0), 2)
                row[f"{who}_gap_p99_ms"] = round(run["event_gap_ms"].get("p99", 0), 2)
        table.append(row)
    sources = [{k: r.get(k) for k in ("device", "date", "commit", "tree_clean")} for r in results]
    return {"benchmark": "peer_vllm", "rows": table, "sources": sources, "files": paths}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_vllm", description=__doc__)
    p.add_argument("measure", choices=["offline", "itl", "serve", "compare"])
    p.add_argument("files", nargs="*", help="compare: result files of both engines")
    p.add_argument("--engine", choices=["ours", "vllm"], default="ours")
    p.add_argument("--model", default="llama-3.2-1b", help="a preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--isl", type=parse_range, default=(100, 1024))
    p.add_argument("--osl", type=parse_range, default=(100, 1024))
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 4096, 16384])
    p.add_argument("--tokens", type=int, default=128, help="itl: tokens timed per sample")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=None, help="ours: (default: the engine's)")
    p.add_argument("--max-num-tokens", type=int, default=None, help="ours: (default: the engine's)")
    p.add_argument("--tokenizer", default=None, help="serve: a model directory's tokenizer")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--serve-isl", dest="isl_text", default="128:512")
    p.add_argument("--serve-osl", dest="osl_text", default="128")
    p.add_argument("--min-requests", type=int, default=32)
    p.add_argument("--processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    p.add_argument("--server-log", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    if args.measure == "compare":
        result = compare(args.files)
        for row in result["rows"]:
            print(json.dumps(row))
        save_json(args.json, result)
        if args.json:
            from benchmarks.plot import plot_side_by_side

            print("wrote", plot_side_by_side(args.json))
        return 0
    import torch

    from benchmarks.provenance import provenance

    engine_name = "vllm" if args.measure == "serve" else args.engine
    result = {
        "benchmark": "peer_vllm",
        "measure": args.measure,
        "engine": engine_name,
        "model": args.model,
        **provenance(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "versions": versions(engine_name),
    }
    if args.measure == "serve":
        result.update(measure_serve(args, result))
    else:
        model_dir = preset_dir(args.model)
        overrides = {
            k: getattr(args, k)
            for k in ("max_batch_size", "max_num_tokens")
            if getattr(args, k) is not None
        }
        engine = load_engine(args.engine, model_dir, args.seed, **overrides)
        result["set_above_defaults"] = overrides
        result["settings"] = engine.settings
        measure = measure_offline if args.measure == "offline" else measure_itl
        result.update(measure(engine, args, vocab_of(model_dir)))
    save_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark: streaming load through tritonserver, against the engine alone.

Closed-loop streaming clients at each concurrency C (see benchmarks/serving_load.py) send the
same requests to each target: `ensemble` over gRPC (tritonclient `async_stream_infer`) and HTTP
`generate_stream`, `tensorrt_llm_bls` over gRPC and `tensorrt_llm` (token ids) over gRPC, the
OpenAI front end's streamed `/v1/completions` (`openai:http`; started beside the server as
`ensemble serve` starts it), and on request perf_analyzer's C++ clients (`ensemble:perf_analyzer`,
see serving_perf_analyzer.py). In the
same run the engine alone (an in-process `Executor` with the same settings) serves the same
prompt ids in the same closed loop: the reference for what the Triton path costs. Output lengths
are exact (min_tokens = max_tokens, or end_id = -1 with `--exact-with end_id`).

Reported per target and concurrency: output tokens/s, requests/s, TTFT, inter-token latency and
end-to-end latency (mean, p50, p90, p99), the gaps between the events a client receives
(`event_gap_ms`: what a streaming client sees, where the inter-token average hides bursts),
events per request, failures; the share of the
engine alone's tokens/s. With `--timeline` the gRPC clients also ask for the perf-metric outputs
and split each request's time into stages (client to engine, queued, to the first token, first
and last token from the engine to the client), on one clock (client and server on one host).
Checks: with `--model null` (a model that computes nothing, so the serving path's own ceiling is
what is measured) every output must be the known one; with `--check-text K`, K greedy requests
sent alone stream exactly the non-streamed text.

    python -m benchmarks.serving --model null --concurrency 1 16 64 --num-requests 256 \\
        --json benchmarks/results/serving_null_cpu.json
    python -m benchmarks.serving --model llama-3.2-1b --tokenizer default --concurrency 1 64 256 \\
        --num-requests 512 --isl 128:512 --osl 128 \\
        --json benchmarks/results/serving_llama1b_h100.json

Requests per concurrency: min(--num-requests, max(--min-requests, 8 x C)).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

from backend.config import EngineConfig
from backend.process.outbox import STATS_PERIOD_S
from benchmarks.sampled_profile import engine_process_pid, sampled_profile
from benchmarks.serving_load import (
    LoadRequest,
    Target,
    engine_closed_loop,
    generate_once,
    run_clients,
    summarize,
)
from benchmarks.serving_perf_analyzer import perf_analyzer_summary
from benchmarks.weight_format_options import (
    add_kv_cache_dtype_option,
    add_weight_format_options,
    weight_format_fields,
)

TARGETS = (
    "ensemble:grpc",
    "ensemble:http",
    "tensorrt_llm_bls:grpc",
    "tensorrt_llm:grpc",
    "openai:http",  # the OpenAI front end's /v1/completions, streamed (started beside the server)
)
# The same load from perf_analyzer (C++ clients) where it is installed; text models only.
PERF_ANALYZER_TARGETS = ("ensemble:perf_analyzer", "tensorrt_llm_bls:perf_analyzer")


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def model_dir_for(model: str, tokenizer: str) -> str:
    """A served model needs a tokenizer: a random-weight preset takes `tokenizer`'s (and its
    vocabulary), anything else brings its own."""
    from backend.loading.disk_cache import cache_root
    from backend.loading.model_paths import resolve_model
    from backend.loading.presets import PRESETS, write_preset

    if model in PRESETS:
        return write_preset(model, cache_root(), tokenizer_from=resolve_model(tokenizer))
    return resolve_model(model)


def make_requests(
    tokenizer, num: int, isl: tuple[int, int], osl: tuple[int, int], seed: int
) -> list[LoadRequest]:
    """Prompts of random ordinary tokens, as text; their ids are what preprocessing makes of it."""
    from preprocessing.tokenizer import encode

    rng = random.Random(seed)
    vocab = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    requests = []
    for _ in range(num):
        length = rng.randint(*isl)
        ids = [
            t for t in (rng.randrange(1000, vocab - 100) for _ in range(length)) if t not in special
        ]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        requests.append(LoadRequest(text, encode(tokenizer, text), rng.randint(*osl)))
    return requests


def null_outputs(tokenizer, requests: list[LoadRequest]) -> list[tuple[list[int], str]]:
    """What the null model must answer: its ids and their text."""
    from backend.models.null import null_token

    expected = []
    for req in requests:
        n = len(req.prompt_ids)
        ids = [null_token(p) for p in range(n, n + req.output_len)]
        expected.append((ids, tokenizer.decode(ids, skip_special_tokens=True)))
    return expected


def count_wrong(records, expected, token_ids: bool) -> int:
    return sum(
        1
        for r in records
        if r.error is None and r.output != expected[r.index][0 if token_ids else 1]
    )


def parse_cpus(text: str) -> set[int]:
    """A CPU list as taskset writes it: "12-15", "0,2,4-7"."""
    cpus = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def split_cpus(client_cpus: str | None) -> tuple[set[int] | None, set[int] | None]:
    """(client CPUs, server CPUs): this process keeps the others, and the server it starts
    (tritonserver, its stubs, the engine) and the engine alone run there, as on a host whose
    clients are elsewhere."""
    if not client_cpus:
        return None, None
    clients = parse_cpus(client_cpus)
    server = os.sched_getaffinity(0) - clients
    if not server or not clients <= os.sched_getaffinity(0):
        raise SystemExit(
            f"--client-cpus {client_cpus}: must be a strict subset of this host's CPUs"
        )
    os.sched_setaffinity(0, server)
    return clients, server


def requests_at(concurrency: int, args) -> int:
    return min(args.num_requests, max(args.min_requests, 8 * concurrency))


def warm_loads(args) -> list[tuple[int, int]]:
    """(concurrency, requests) of the warm-up loads: every level once, the largest first, so
    that no measured level is the first to meet its batch shapes (kernel compiles)."""
    levels = sorted(set(args.concurrency), reverse=True)
    return [
        (c, requests_at(c, args) if c == levels[0] else min(requests_at(c, args), 4 * c))
        for c in levels
    ]


def settings_for(args, model_dir: str):
    from ensemble.server import free_port
    from ensemble.settings import ServeSettings

    top = max(args.concurrency)
    osl = parse_range(args.osl)
    return ServeSettings(
        model_path=model_dir,
        device=args.device,
        dtype=args.dtype,
        **weight_format_fields(args),
        kv_cache_dtype=args.kv_cache_dtype,
        max_batch_size=top,
        max_num_tokens=args.max_num_tokens,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        # The server's defaults (the model's context, the pool from free memory) unless pinned.
        max_seq_len=args.max_seq_len,
        max_tokens_in_paged_kv_cache=args.kv_tokens,
        default_max_tokens=osl[1],
        triton_max_batch_size=min(64, top),
        postprocessing_batching=args.postprocessing_batching,
        preprocessing_instance_count=4,
        llm_instance_count=args.llm_instances,
        response_rate_limit=args.response_rate_limit,
        stream_interval=args.stream_interval,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )


# The engine's step counters (ExecutorStats fields) and their samples among the server's metrics.
STEP_COUNTERS = {
    "num_iterations": 'general_type="iteration_counter"',
    "num_context_iterations": 'metric="context_iterations"',
    "step_seconds": 'engine_step_metric="step_seconds"',
    "device_wait_seconds": 'engine_step_metric="device_wait_seconds"',
    "num_decode_streak_steps": 'engine_step_metric="decode_streak_steps"',
    "decode_streak_seconds": 'engine_step_metric="decode_streak_seconds"',
}


def stats_counts(stats) -> dict[str, float]:
    return {name: getattr(stats, name) for name in STEP_COUNTERS}


def step_counts(before: dict[str, float], after: dict[str, float], row: dict) -> dict:
    """The engine's steps during a load, from its counters: more steps for the same tokens means
    emptier batches; longer steps, slower ones (prompt chunks run as eager steps). The step
    thread's share not spent waiting for the device says whether the host paces the steps, and
    a decode step right after another is the steady step, free of prompt chunks' time."""
    d = {name: after[name] - before[name] for name in STEP_COUNTERS}
    steps, streak = d["num_iterations"], d["num_decode_streak_steps"]
    return {
        "engine_steps": steps,
        "engine_context_steps": d["num_context_iterations"],
        "ms_per_step": 1e3 * row["wall_s"] / steps if steps else None,
        "tokens_per_step": row["output_tokens"] / steps if steps else None,
        "host_share": 1 - d["device_wait_seconds"] / d["step_seconds"]
        if d["step_seconds"]
        else None,
        "ms_per_decode_step": 1e3 * d["decode_streak_seconds"] / streak if streak else None,
        # the other steps: those with prompt chunks and the decode step after each
        "ms_per_other_step": 1e3 * (d["step_seconds"] - d["decode_streak_seconds"]) / others
        if (others := steps - streak)
        else None,
        "step_counters": d,
    }


def metrics_counts(metrics_url: str) -> dict[str, float]:
    """The engine's step counters from the server's metrics, once they are current."""
    import urllib.request

    time.sleep(3 * STATS_PERIOD_S)  # the gauges are refreshed every stats period
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = dict.fromkeys(STEP_COUNTERS, 0.0)
    for line in text.splitlines():
        for name, label in STEP_COUNTERS.items():
            if label in line and not line.startswith("#"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


COMPILE_LINE = re.compile(r"kernel (\w+) compiled after the warm-up \(([\d.]+) s")


def logged_compiles(server_log: Path) -> list[str]:
    """The kernel compiles after the warm-up that the engine has logged so far ("name 1.23 s")."""
    try:
        text = server_log.read_text(errors="replace")
    except OSError:
        return []
    return [f"{name} {seconds} s" for name, seconds in COMPILE_LINE.findall(text)]


def run_engine_alone(settings, requests, args, expected) -> list[dict]:
    from backend.engine.executor import Executor
    from backend.runner import compile_watch

    executor = Executor(settings.engine_config())

    def counts() -> dict[str, float]:
        return stats_counts(executor.stats())

    def compiles() -> list[str]:
        return [f"{k.kernel} {k.seconds:.2f} s" for k in compile_watch.compiles()]

    try:
        jitters = [0.0, *args.engine_jitter_ms]
        return engine_loads(executor, "engine", requests, args, counts, jitters, compiles, expected)
    finally:
        executor.shutdown()


def run_engine_process(settings, requests, args) -> list[dict]:
    """The same loads through an engine process driven from here (`EngineProcess`: the IPC,
    the engine's output and request threads; no Triton): where the Triton path's cost lies."""
    from backend.process.client import EngineProcess

    engine = EngineProcess(settings.engine_config())

    def counts() -> dict[str, float]:
        time.sleep(3 * STATS_PERIOD_S)  # the engine sends its stats every stats period
        return stats_counts(engine.stats())

    try:
        return engine_loads(engine, "engine:process", requests, args, counts, [0.0])
    finally:
        engine.shutdown()


def profile_path(args, target: str, concurrency: int) -> Path | None:
    if not args.profile_dir:
        return None
    return Path(args.profile_dir) / f"{target.replace(':', '_')}_c{concurrency}.txt"


def engine_loads(
    engine, target, requests, args, counts, jitters, compiles=None, expected=None
) -> list[dict]:
    """Warm `engine` (an Executor or an EngineProcess), then one closed loop per jitter and
    concurrency; a row each, with the engine's steps (`counts`) and the compiles meanwhile."""
    warm = [LoadRequest(r.text, list(reversed(r.prompt_ids)), r.output_len) for r in requests]
    for c, n in warm_loads(args):
        engine_closed_loop(engine, warm[:n], c, args.exact_with)
    rows = []
    for jitter_ms in jitters:
        for c in args.concurrency:
            load = requests[: requests_at(c, args)]
            before, compiled = counts(), len(compiles()) if compiles else 0
            name = f"{target}:jitter{jitter_ms:g}ms" if jitter_ms else target
            pid = getattr(getattr(engine, "process", None), "pid", os.getpid())
            with sampled_profile(pid, profile_path(args, name, c)):
                records = engine_closed_loop(engine, load, c, args.exact_with, jitter_ms / 1e3)
            row = {"target": name, "concurrency": c, **summarize(records, load)}
            row.update(step_counts(before, counts(), row))
            if compiles:
                row["kernel_compiles"] = compiles()[compiled:]
            if expected:
                row["wrong_outputs"] = count_wrong(records, expected, token_ids=True)
            rows.append(row)
            _print(row)
    return rows


def run_server_loads(
    settings, requests, args, expected, server_log: Path
) -> tuple[list[dict], dict]:
    from ensemble.build import build_repository
    from ensemble.server import TritonServer

    repository = build_repository(
        settings, Path(tempfile.mkdtemp(prefix="serving-bench-")) / "repo"
    )
    server = TritonServer(
        repository,
        settings.http_port,
        settings.grpc_port,
        settings.metrics_port,
        log_file=server_log,
    )
    rows, checks = [], {}

    front_end = None

    def gone() -> str | None:
        code = server.process.poll()
        if code is not None:
            return f"tritonserver exited with code {code} (log {server_log})"
        code = front_end.exit_code() if front_end is not None else None
        return None if code is None else f"the OpenAI front end exited with code {code}"

    with server:
        if any(spec.startswith("openai:") for spec in args.targets):
            front_end, served_name = start_front_end(settings)
        warm = [
            LoadRequest(r.text[::-1], list(reversed(r.prompt_ids)), r.output_len) for r in requests
        ]
        for c, n in warm_loads(args):
            target = Target("grpc", "ensemble", server.grpc_url, args.exact_with)
            run_clients(target, warm[:n], c, args.processes, gone, cpus=args.client_cpu_set)
        for spec in args.targets:
            model, kind = spec.split(":")
            url = server.http_url if kind == "http" else server.grpc_url
            if model == "openai":
                model, kind, url = served_name, "openai", f"localhost:{front_end.port}"
            for c in args.concurrency:
                load = requests[: requests_at(c, args)]
                if kind == "perf_analyzer":
                    summary = perf_analyzer_summary(url, model, load, c, args.exact_with)
                    rows.append({"target": spec, "concurrency": c, **summary})
                    _print(rows[-1])
                    continue
                timed = args.timeline and kind == "grpc"
                before = metrics_counts(server.metrics_url)
                compiled = len(logged_compiles(server_log))
                with sampled_profile(engine_process_pid(), profile_path(args, spec, c)):
                    records = run_clients(
                        Target(kind, model, url, args.exact_with, timed),
                        load,
                        c,
                        args.processes,
                        gone,
                        cpus=args.client_cpu_set,
                    )
                row = {"target": spec, "concurrency": c, **summarize(records, load)}
                row.update(step_counts(before, metrics_counts(server.metrics_url), row))
                row["kernel_compiles"] = logged_compiles(server_log)[compiled:]
                if expected:
                    row["wrong_outputs"] = count_wrong(records, expected, model == "tensorrt_llm")
                rows.append(row)
                _print(row)
        if args.check_text:
            checks = check_streamed_text(
                server.http_url, requests[: args.check_text], args.exact_with
            )
            print(f"streamed == non-streamed: {checks}", flush=True)
        if front_end is not None:
            front_end.stop()
    return rows, checks


def start_front_end(settings, timeout_s: float = 120.0):
    """The OpenAI front end over the running server, as `ensemble serve` starts it; returns it
    once it listens, with the name it serves the model under."""
    import json
    import urllib.request

    from ensemble.openai_server.process import FrontEndProcess
    from ensemble.server import free_port, wait_listening

    front_end = FrontEndProcess(
        free_port(),
        settings.grpc_port,
        settings.metrics_port,
        settings.model_path,
        settings.tokenizer_dir,
    ).start()
    try:
        wait_listening(front_end.port, front_end.exit_code, timeout_s)
        with urllib.request.urlopen(f"{front_end.url}/models", timeout=10) as response:
            return front_end, json.loads(response.read())["data"][0]["id"]
    except BaseException:
        front_end.stop()
        raise


def check_streamed_text(http_url: str, requests, exact_with: str) -> dict:
    """Each request alone, greedy, through the ensemble: generate vs generate_stream. A first
    generate puts the prompt in the prefix cache, so that both compared runs reuse it: a prompt
    computed in one pass and one read back from the cache differ in rounding (bf16), enough to
    change a greedy pick of a random-weight model."""
    same = 0
    for req in requests:
        generate_once(http_url, "ensemble", req, exact_with, stream=False)
        whole = generate_once(http_url, "ensemble", req, exact_with, stream=False)
        streamed = generate_once(http_url, "ensemble", req, exact_with, stream=True)
        same += whole == streamed
    return {"requests": len(requests), "equal": same}


def share_of_engine(rows: list[dict]) -> None:
    engine = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["target"] == "engine"}
    for r in rows:
        if r["target"] != "engine" and r["concurrency"] in engine:
            r["share_of_engine"] = round(r["output_tokens_per_s"] / engine[r["concurrency"]], 3)


def _print(row: dict) -> None:
    ttft, itl, gap = row["ttft_ms"], row["itl_ms"], row.get("event_gap_ms", {})
    print(
        f"{row['target']:>22} c={row['concurrency']:<4} {row['output_tokens_per_s']:9.0f} tok/s "
        f"{row['requests_per_s']:7.1f} req/s  TTFT p50 {ttft.get('p50', 0):8.1f} ms  "
        f"ITL p50 {itl.get('p50', 0):6.2f} ms  gap p50/p99 {gap.get('p50', 0):6.1f}/"
        f"{gap.get('p99', 0):6.1f} ms  {row['responses_per_request']:5.1f} events/req  "
        f"failed {row['failed']}"
        + (f"  wrong {row['wrong_outputs']}" if "wrong_outputs" in row else ""),
        flush=True,
    )
    if row.get("engine_steps"):
        print(
            f"{'':>22} engine: {row['engine_steps']:.0f} steps "
            f"({row['engine_context_steps']:.0f} with prompt chunks), "
            f"{row['ms_per_step']:.2f} ms and {row['tokens_per_step']:.1f} output tokens a step"
            + (f", host {row['host_share']:.0%}" if row.get("host_share") is not None else "")
            + (
                f", steady decode {row['ms_per_decode_step']:.2f} ms"
                f", other {row['ms_per_other_step']:.2f} ms"
                if row.get("ms_per_decode_step") and row.get("ms_per_other_step")
                else ""
            ),
            flush=True,
        )
    if row.get("kernel_compiles"):
        print(f"{'':>22} kernels compiled during the load: {row['kernel_compiles']}", flush=True)
    if "timeline_ms" in row:
        stages = ", ".join(f"{k} {v['p50']:.1f}" for k, v in row["timeline_ms"].items())
        print(f"{'':>22} p50 ms: {stages}", flush=True)


def plot(result: dict, out: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    rows = result["runs"]
    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(1, 5, figsize=(23, 4.2))
    panels = (
        ("output_tokens_per_s", None, "output tokens/s"),
        ("ttft_ms", "p50", "TTFT p50 (ms)"),
        ("e2e_ms", "p50", "end-to-end latency p50 (ms)"),
        ("itl_ms", "p50", "inter-token latency p50 (ms)"),
        ("event_gap_ms", "p99", "gap between events p99 (ms)"),
    )
    for target in targets:
        mine = sorted((r for r in rows if r["target"] == target), key=lambda r: r["concurrency"])
        cs = [r["concurrency"] for r in mine]
        style = "k--" if target == "engine" else "o-"
        for ax, (key, stat, _) in zip(axes, panels):
            points = [(c, r.get(key, {}).get(stat) if stat else r[key]) for c, r in zip(cs, mine)]
            points = [(c, v) for c, v in points if v is not None]  # perf_analyzer: no ITL, E2E
            ax.plot([c for c, _ in points], [v for _, v in points], style, label=target)
    for ax, (_, _, label) in zip(axes, panels):
        ax.set(xscale="log", xlabel="concurrency", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{result['model']} — ISL {result['isl']}, OSL {result['osl']} — {result['device']}, "
        f"{result['date']}, {result['commit']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--model", default="null", help="null, default, a preset, a HF dir or a .gguf")
    p.add_argument("--tokenizer", default="default", help="the tokenizer (and vocab) of a preset")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    add_weight_format_options(p)
    add_kv_cache_dtype_option(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-requests", type=int, default=32)
    p.add_argument("--isl", default="128:512")
    p.add_argument("--osl", default="128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--targets", nargs="+", default=list(TARGETS), choices=TARGETS + PERF_ANALYZER_TARGETS
    )
    p.add_argument("--exact-with", default="min_tokens", choices=("min_tokens", "end_id"))
    p.add_argument(
        "--processes",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="client processes",
    )
    p.add_argument(
        "--client-cpus",
        default=None,
        help="CPU list (e.g. 12-15) for the client processes; the server and the engine alone "
        "run on the others",
    )
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=EngineConfig.cuda_graph_max_tokens,
        help="steps with prompt tokens up to this many replay CUDA graphs (0: eagerly)",
    )
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="pin the KV cache size in tokens (default: the server's, from free GPU memory)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="pin max_seq_len (default: the server's, the model's context)",
    )
    p.add_argument("--no-engine-alone", action="store_true")
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="also run the loads through an engine process driven from the benchmark (its IPC "
        "and threads without Triton)",
    )
    p.add_argument(
        "--engine-jitter-ms",
        type=float,
        nargs="*",
        default=[],
        help="also run the engine alone with each slot's next request sent a random 0..X ms "
        "after its last ended (a diagnostic: arrivals spread as a server's round trips spread "
        "them)",
    )
    p.add_argument(
        "--postprocessing-batching",
        action="store_true",
        help="batch postprocessing (faster; ensemble cancellation then stops at Triton)",
    )
    p.add_argument(
        "--llm-instances",
        type=int,
        default=1,
        help="Triton instances (stub processes) of tensorrt_llm, sharing its one engine",
    )
    p.add_argument(
        "--response-rate-limit",
        type=int,
        default=0,
        help="responses/s tensorrt_llm aims at under load (0: every token at once)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the engine's stream_interval (tokens per streamed output after the first), "
        "for the server and the engine alone",
    )
    p.add_argument("--check-text", type=int, default=4)
    p.add_argument(
        "--profile-dir",
        default=None,
        help="write a sampling profile of the engine (py-spy, collapsed stacks) per load here",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="gRPC targets ask for the perf-metric outputs: where a request's time goes "
        "(client to engine, queued, first token, engine to client); larger responses",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--server-log", default=None)
    args = p.parse_args(argv)
    args.client_cpu_set, server_cpus = split_cpus(args.client_cpus)

    from backend.runner.device import pick_device
    from benchmarks.provenance import provenance, save_json
    from preprocessing.tokenizer import load_tokenizer

    if args.model == "null":
        # Its tensors are tiny: OpenMP's spinning workers would only take cores from the server.
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    model_dir = model_dir_for(args.model, args.tokenizer)
    tokenizer = load_tokenizer(model_dir)
    isl, osl = parse_range(args.isl), parse_range(args.osl)
    requests = make_requests(tokenizer, args.num_requests, isl, osl, args.seed)
    expected = null_outputs(tokenizer, requests) if args.model == "null" else None
    settings = settings_for(args, model_dir)
    result = {
        "benchmark": "serving",
        "model": args.model,
        "isl": args.isl,
        "osl": args.osl,
        **provenance(pick_device(args.device)),
        "exact_with": args.exact_with,
        "client_processes": args.processes,
        "client_cpus": sorted(args.client_cpu_set or ()),
        "server_cpus": sorted(server_cpus or ()),
        "mean_prompt_tokens": sum(len(r.prompt_ids) for r in requests) / len(requests),
        "settings": {f.name: getattr(settings, f.name) for f in fields(settings)},
        "pinned_below_defaults": [
            name for name in ("max_seq_len", "kv_tokens") if getattr(args, name) is not None
        ],
        "runs": [],
    }
    if not args.no_engine_alone:
        result["runs"] += run_engine_alone(settings, requests, args, expected)
    if args.engine_process:
        result["runs"] += run_engine_process(settings, requests, args)
    log = Path(
        args.server_log or Path(tempfile.gettempdir()) / f"serving-bench-{time.time():.0f}.log"
    )
    print(f"tritonserver log: {log}", flush=True)
    rows, checks = run_server_loads(settings, requests, args, expected, log)
    result["runs"] += rows
    result["streamed_text_check"] = checks
    share_of_engine(result["runs"])
    save_json(args.json, result)
    if args.json:
        print("wrote", args.json, plot(result, args.json.replace(".json", ".png")) or "")
    failed = sum(r["failed"] + r.get("wrong_outputs", 0) for r in result["runs"])
    unequal = checks and checks["equal"] != checks["requests"]
    return 1 if failed or unequal else 0


if __name__ == "__main__":
    sys.exit(main())

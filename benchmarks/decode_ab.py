"""Decode step time of engine variants, alternated in one process.

Each variant is an executor whose decode CUDA graphs were captured with one of the engine's
choices changed, or, as a diagnostic, with a part of the step left out. Every round measures each
variant once, as `benchmarks.decode_floor` does, so all of them see the same GPU in the same
state. On one H100 the medians of six rounds at batch 1 repeated within ~5 us, where the same code
in separate processes differed by up to ~30 us.

    python -m benchmarks.decode_ab --variants default no_attention splits=1 --rounds 6 --json OUT

Variants (the changes apply while the variant's graphs are captured; decode steps replay them):
  default           the engine as it is
  splits=N          at most N decode-attention splits per (request, kv head)
  qkv:KEY=V,...     the qkv+rotary kernel's launch config (e.g. qkv:BLOCK_N=8,num_stages=2)
  merge:KEY=V,...   the launch config of GEMVs that merge attention splits (batch 1: the o
                    projection)
  attention:KEY=V   the decode-attention kernel's launch config (e.g. attention:num_warps=4)
  attention_merges  batch 1: decode attention merges its splits itself (an arrival counter, the
                    last split merges), instead of the o projection merging them as it reads them
  torch_embedding   torch's embedding lookup instead of the PDL kernel
  no_attention      diagnostic: attention returns its queries (wrong tokens, same step otherwise;
                    at batch 1 through the o projection's plain path, no split merge)
  no_argmax         diagnostic: the graph leaves out its greedy argmax (and so never moves on
                    to the other input slot: wrong tokens)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from unittest import mock

import torch

from backend.config import EngineConfig
from backend.engine.executor import Executor
from benchmarks.decode_floor import copy_rate_bytes_per_s, measure
from benchmarks.provenance import provenance, save_json
from benchmarks.weight_format_options import add_weight_format_options, weight_format_fields


def _launch_overrides(variant: str) -> dict[str, int]:
    """ "kernel:KEY=V,KEY=V" -> {KEY: V}."""
    pairs = (item.split("=") for item in variant.split(":", 1)[1].split(","))
    return {key: int(value) for key, value in pairs}


def _changes(variant: str) -> list:
    """The patches that make `variant`, as context managers."""
    import backend.attention.kernels.decode_launch as decode_launch
    import backend.attention.triton_backend as triton_backend
    import backend.kernels.gemv as gemv
    import backend.kernels.qkv_rope as qkv_rope
    import backend.layers.embedding as embedding
    import backend.runner.decode_graphs as cuda_graphs

    if variant == "default":
        return []
    if variant.startswith("splits="):
        most, choose = int(variant.split("=", 1)[1]), decode_launch.choose_num_splits
        return [
            mock.patch.object(decode_launch, "choose_num_splits", lambda *a: min(most, choose(*a)))
        ]
    if variant.startswith("qkv:"):
        override = _launch_overrides(variant)
        base = qkv_rope.checked_config
        return [
            mock.patch.object(
                qkv_rope,
                "checked_config",
                lambda n, k, config, **kw: base(n, k, {**(config or {}), **override}, **kw),
            )
        ]
    if variant.startswith("merge:"):
        override = _launch_overrides(variant)
        base = gemv.checked_config

        def merge_config(n, k, config, merge=False, **kw):
            return base(n, k, {**(config or {}), **override} if merge else config, merge, **kw)

        return [mock.patch.object(gemv, "checked_config", merge_config)]
    if variant.startswith("attention:"):
        override = _launch_overrides(variant)
        base_attention = decode_launch.launch_config
        return [
            mock.patch.object(
                decode_launch,
                "launch_config",
                lambda *a, **kw: {**base_attention(*a, **kw), **override},
            )
        ]
    if variant == "attention_merges":
        return [mock.patch.object(gemv, "takes_partials", lambda weight, head_dim: False)]
    if variant == "no_attention":
        return [
            mock.patch.object(gemv, "takes_partials", lambda weight, head_dim: False),
            mock.patch.object(
                triton_backend, "paged_attention", lambda q, k_cache, v_cache, meta, scale: q
            ),
        ]
    if variant == "no_argmax":
        return [mock.patch.object(cuda_graphs, "argmax_rows", lambda logits, out, to_host: out)]
    if variant == "torch_embedding":
        return [mock.patch.object(embedding, "fused_embedding", None)]
    raise ValueError(f"unknown variant {variant!r} (see python -m benchmarks.decode_ab --help)")


def build(variant: str, model: str, batch: int, isl: int, n2: int, formats: dict) -> Executor:
    seq = isl + n2 + 1
    config = EngineConfig(
        model_path=model,
        **formats,
        max_batch_size=batch,
        max_num_tokens=max(2048, batch * isl),
        max_seq_len=seq,
        max_tokens_in_paged_kv_cache=batch * (seq + 64),
        enable_kv_cache_reuse=False,
    )
    with contextlib.ExitStack() as stack:
        for change in _changes(variant):
            stack.enter_context(change)
        return Executor(config)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_ab",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__[__doc__.index("Variants") :],
    )
    p.add_argument("--variants", nargs="+", default=["default", "no_attention"])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--n1", type=int, default=16)
    p.add_argument("--n2", type=int, default=144)
    p.add_argument("--rounds", type=int, default=6)
    add_weight_format_options(p, help="weight format of every variant")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for variant in args.variants:  # unknown names fail before anything is built
        try:
            _changes(variant)
        except ValueError as e:
            p.error(str(e))
    if not torch.cuda.is_available():
        p.error("needs a GPU: the variants differ in their decode CUDA graphs")
    executors = {
        v: build(v, args.model, args.batch, args.isl, args.n2, weight_format_fields(args))
        for v in args.variants
    }
    device = torch.device("cuda")
    rate = copy_rate_bytes_per_s(device)
    steps: dict[str, list[float]] = {v: [] for v in executors}
    floor_ms = 0.0
    for round_ in range(args.rounds):
        for variant, executor in executors.items():
            r = measure(executor, args.batch, args.isl, args.n1, args.n2, repeats=3, window=None)
            steps[variant].append(r["step_ms"])
            floor_ms = r["bytes_per_step"] / rate * 1e3
        print(
            f"round {round_ + 1}: " + ", ".join(f"{v} {s[-1]:.4f}" for v, s in steps.items()),
            flush=True,
        )
    result = {
        "benchmark": "decode_ab",
        **provenance(device),
        "model": args.model,
        "batch": args.batch,
        "isl": args.isl,
        # Pinned below the server's defaults (build): the variants' graphs differ, not their sizes.
        "max_seq_len": args.isl + args.n2 + 1,
        "max_seq_len_pinned": True,
        "kv_pool_pinned": True,
        **weight_format_fields(args),
        "rounds": args.rounds,
        "floor_ms": round(floor_ms, 4),
        "copy_rate_tb_s": round(rate / 1e12, 3),
        "variants": {},
    }
    for variant, s in steps.items():
        median = statistics.median(s)
        result["variants"][variant] = {
            "median_step_ms": round(median, 4),
            "step_ms_all": s,
            "fraction_of_floor": round(floor_ms / median, 3),
        }
        print(f"{variant:24s} {median:.4f} ms  {floor_ms / median:.3f} of the floor", flush=True)
    for executor in executors.values():
        executor.shutdown()
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

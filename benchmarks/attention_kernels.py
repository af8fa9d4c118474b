"""GPU check and timing of the Triton attention kernels (run on a CUDA machine).

    python -m benchmarks.attention_kernels [--sweep [--write-tuning]] [--skip-check]

1. Correctness in bf16 on model-sized shapes against the fp32 torch reference (relative error).
2. KV write and decode, timed as CUDA-graph replays (decode runs under graphs in serving; this also
   removes host launch cost). Each graph runs the call over several metadata sets whose blocks are
   spread over a 1M-token cache, so the bytes read exceed L2. Decode bandwidth counts the K/V bytes
   that must be read: sum(seq_lens) * kv_heads * head_dim * 2 (K and V) * 2 bytes.
3. Prefill: causal TFLOP/s for one long prompt, a chunk over a cached prefix, several prompts and a
   chunk mixed with decodes (triton.testing.do_bench medians, L2 flushed between calls), next to
   torch's scaled_dot_product_attention on contiguous K/V (no paging) as a yardstick.
4. The fused RMSNorm(+residual) and rotary kernels (backend/kernels) next to the model's torch code.
--sweep also times other split counts, tile shapes, warps and pipeline stages; with
--write-tuning it writes the fastest (least total time over the cases of a shape key) into
backend/kernels/tuning/{decode,prefill}_attention.json under this GPU's name.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from backend.attention import kv_dtype as kv_dtype_rules
from backend.attention import reference
from backend.attention.kernels import decode, decode_launch, kv_write, prefill
from backend.attention.metadata import AttentionMetadata
from backend.kernels import tuning
from benchmarks.graph_timing import graph_us_per_call
from benchmarks.provenance import provenance, save_json

TOKENS_PER_BLOCK = 32
CACHE_TOKENS = 1 << 20


def make_meta(query_lens, seq_lens, num_blocks, device, gen):
    """Random (shuffled) block tables into a cache of num_blocks blocks."""
    per_seq = [math.ceil(s / TOKENS_PER_BLOCK) for s in seq_lens]
    physical = torch.randperm(num_blocks, generator=gen)[: sum(per_seq)].tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor([physical.pop() for _ in range(n)], dtype=torch.int32)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


def run_kernel(query, k_cache, v_cache, meta, scale, **kw):
    if meta.max_query_len == 1:
        return decode.decode_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_seq_len,
            scale,
            **kw,
        )
    return prefill.prefill_attention(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, **kw
    )


class Setup:
    def __init__(self, heads, kv_heads, head_dim, kv_dtype: str = "bf16"):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.num_blocks = CACHE_TOKENS // TOKENS_PER_BLOCK
        shape = (self.num_blocks, TOKENS_PER_BLOCK, kv_heads, head_dim)
        self.kv_dtype = kv_dtype
        self.k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.scales = {}
        if kv_dtype == "fp8":  # values and a scale per token and kv head, as the cache stores them
            self.k_cache, k_scales = kv_dtype_rules.quantize(self.k_cache, torch.float8_e4m3fn)
            self.v_cache, v_scales = kv_dtype_rules.quantize(self.v_cache, torch.float8_e4m3fn)
            self.scales = dict(k_scales=k_scales, v_scales=v_scales)
        self.gen = torch.Generator().manual_seed(0)

    def name(self):
        return (
            f"H={self.heads} KV={self.kv_heads} D={self.head_dim} {self.kv_dtype} "
            f"block {TOKENS_PER_BLOCK}"
        )

    def vector_bytes(self) -> int:
        """Bytes of one token's key (or value) of one kv head, its scale included."""
        return kv_dtype_rules.vector_bytes(self.head_dim, self.k_cache.dtype)

    def meta(self, q_lens, s_lens):
        return make_meta(q_lens, s_lens, self.num_blocks, "cuda", self.gen)

    def query(self, n):
        return torch.randn(n, self.heads, self.head_dim, device="cuda", dtype=torch.bfloat16)


def check_correctness(s: Setup):
    print(f"== correctness {s.name()}: ||out-ref|| / ||ref|| vs fp32 reference")
    k32, v32 = s.k_cache.float(), s.v_cache.float()
    cases = {
        "decode bs=5": ([1] * 5, [1, 31, 32, 700, 3000], {}),
        "decode bs=3, 16 splits": ([1] * 3, [1, 100, 5000], {"num_splits": 16}),
        "prefill + prefix + decodes": ([300, 1, 77, 1], [300, 901, 1077, 33], {}),
    }
    for name, (q_lens, s_lens, kw) in cases.items():
        meta = s.meta(q_lens, s_lens)
        query = s.query(sum(q_lens))
        out = run_kernel(query, s.k_cache, s.v_cache, meta, s.scale, **kw).float()
        ref = reference.paged_attention(query.float(), k32, v32, meta, s.scale)
        err = ((out - ref).norm() / ref.norm()).item()
        print(f"  {name:30s} rel err {err:.2e} {'OK' if err < 1e-2 else 'FAIL'}")
    del k32, v32


def bench_kv_write(s: Setup):
    num_tokens = 8192
    key, value = s.query(num_tokens)[:, : s.kv_heads], s.query(num_tokens)[:, : s.kv_heads]
    slots = [torch.randperm(CACHE_TOKENS, device="cuda")[:num_tokens] for _ in range(4)]
    us = graph_us_per_call(
        [lambda sl=sl: kv_write.write_kv(key, value, s.k_cache, s.v_cache, sl) for sl in slots]
    )
    nbytes = num_tokens * s.kv_heads * s.head_dim * 2 * 2 * 2  # K and V, read and write
    print(f"== kv write {s.name()}: {num_tokens} tokens {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s")


def bench_decode(
    s: Setup, shapes, sweep, rows: list | None = None, configs_too: bool = True
) -> dict[str, dict[str, dict]]:
    """Prints the timings (and appends them to `rows`, as dicts); returns shape key -> config as
    JSON -> case -> us (at the chosen splits). `sweep`: other split counts, and other configs
    with `configs_too`."""
    print(f"== decode {s.name()} (CUDA graph replays)")
    print(f"  {'bs':>4} {'ctx':>6} {'splits':>6} {'config':>12} {'us':>8} {'GB/s':>7}")
    default = decode_launch.launch_config
    device_name = tuning.device_name(torch.device("cuda"))
    timings: dict[str, dict[str, dict]] = {}
    configs = [None]
    if sweep and configs_too:
        uncapped = [(32, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 3), (64, 8, 3), (128, 8, 3)]
        uncapped += [(32, 2, 1), (32, 4, 1), (64, 4, 1), (64, 2, 1), (128, 4, 1), (32, 2, 2)]
        uncapped += [(64, 2, 2), (16, 2, 1)]
        capped = [(32, 2, 2, 128), (32, 2, 1, 128), (32, 4, 1, 96), (64, 4, 1, 96)]  # maxnreg
        capped += [(16, 2, 1, 96), (16, 2, 2, 96), (32, 4, 1, 128)]
        configs += [dict(BLOCK_N=n, num_warps=w, num_stages=st) for n, w, st in uncapped]
        configs += [
            dict(BLOCK_N=n, num_warps=w, num_stages=st, maxnreg=r) for n, w, st, r in capped
        ]
    for bs, ctx in shapes:
        nbytes = bs * ctx * s.kv_heads * s.vector_bytes() * 2
        sets = max(2, min(32, math.ceil(512e6 / nbytes)))
        metas = [s.meta([1] * bs, [ctx] * bs) for _ in range(sets)]
        query = s.query(bs)
        config = decode_launch.config_for(query, s.k_cache, bs)
        chosen = decode_launch.splits_for(config, query, s.k_cache, bs, ctx)
        few = decode_launch.has_few_programs(bs, s.kv_heads, query.device)
        scaled = s.kv_dtype != "bf16"
        key = decode_launch.tuning_key(s.head_dim, few, scaled)
        runs = [(None, chosen)]
        if sweep:
            runs += [(None, n) for n in (1, 2, 4, 8, 16, 32, 64) if n != chosen]
            runs += [(cfg, chosen) for cfg in configs[1:]]
        for cfg, splits in runs:
            decode_launch.launch_config = (lambda hd, few, dev, sc, c=cfg: c) if cfg else default
            try:
                us = graph_us_per_call(
                    [
                        lambda m=m, n=splits: decode.decode_attention(
                            query,
                            s.k_cache,
                            s.v_cache,
                            m.block_tables,
                            m.seq_lens,
                            m.query_start_loc,
                            m.max_seq_len,
                            s.scale,
                            num_splits=n,
                            **s.scales,
                        )
                        for m in metas
                    ]
                )
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"  {bs:4d} {ctx:6d} {splits:6d} {cfg} failed: {type(e).__name__}")
                continue
            label = (
                "default"
                if cfg is None
                else f"N{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
                + (f" r{cfg['maxnreg']}" if cfg.get("maxnreg") else "")
            )
            mark = "*" if (cfg is None and splits == chosen) else " "
            print(
                f" {mark}{bs:4d} {ctx:6d} {splits:6d} {label:>12} {us:8.1f} "
                f"{nbytes / us / 1e3:7.0f}"
            )
            if rows is not None:
                rows.append(
                    dict(
                        setup=s.name(),
                        batch=bs,
                        context=ctx,
                        splits=splits,
                        config=label,
                        us=round(us, 1),
                        gb_s=round(nbytes / us / 1e3),
                        heuristic_splits=mark == "*",
                    )
                )
            if splits == chosen:
                used = json.dumps(
                    dict(cfg or default(s.head_dim, few, device_name, scaled)), sort_keys=True
                )
                timings.setdefault(key, {}).setdefault(used, {})[(bs, ctx)] = us
    decode_launch.launch_config = default
    return timings


def causal_flops(q_lens, s_lens, s: Setup):
    visible = sum(q * (sl - q) + q * (q + 1) // 2 for q, sl in zip(q_lens, s_lens))
    return 4 * visible * s.head_dim * s.heads


def bench_prefill(s: Setup, tiles, sweep) -> dict[str, dict[str, dict]]:
    """Prints the timings; returns shape key -> config as JSON -> case -> ms."""
    print(f"== prefill {s.name()} (do_bench medians)")
    print(f"  {'case':>24} {'config':>20} {'ms':>8} {'TFLOP/s':>8}")
    cases = {
        "prompt 4096": ([4096], [4096]),
        "chunk 2048 + prefix 2048": ([2048], [4096]),
        "8 x 512 prompts": ([512] * 8, [512] * 8),
        "chunk 1024 + 64 decodes": ([1024] + [1] * 64, [2048] + [1024] * 64),
    }
    default = prefill.launch_config
    variants = [None] + (tiles if sweep else [])
    key = prefill.tuning_key(s.heads // s.kv_heads, s.head_dim, s.k_cache.element_size())
    default_config = default(
        s.heads // s.kv_heads,
        s.head_dim,
        s.k_cache.element_size(),
        tuning.device_name(s.k_cache.device),
    )
    timings: dict[str, dict] = {}
    for name, (q_lens, s_lens) in cases.items():
        meta = s.meta(q_lens, s_lens)
        query = s.query(sum(q_lens))
        flops = causal_flops(q_lens, s_lens, s)
        for tile in variants:
            if tile:
                config = dict(
                    BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=tile[2], num_stages=tile[3]
                )
                prefill.launch_config = lambda g, hd, es, dev, c=config: c
            else:
                config = dict(default_config)
                prefill.launch_config = default
            try:
                ms = do_bench(
                    lambda: run_kernel(query, s.k_cache, s.v_cache, meta, s.scale),
                    warmup=25,
                    rep=100,
                    return_mode="median",
                )
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"  {name:>24} {str(tile):>20} failed: {type(e).__name__}")
                continue
            timings.setdefault(json.dumps(config, sort_keys=True), {})[name] = ms
            label = "default" if tile is None else "M{} N{} w{} s{}".format(*tile)
            print(f"  {name:>24} {label:>20} {ms:8.3f} {flops / ms / 1e9:8.1f}")
        if len(q_lens) == 1 and q_lens == s_lens:  # yardstick: torch SDPA, contiguous K/V
            L = q_lens[0]
            q = torch.randn(1, s.heads, L, s.head_dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, s.heads, L, s.head_dim, device="cuda", dtype=torch.bfloat16)
            ms = do_bench(
                lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True),
                warmup=25,
                rep=100,
                return_mode="median",
            )
            print(f"  {name:>24} {'torch sdpa (MHA)':>20} {ms:8.3f} {flops / ms / 1e9:8.1f}")
    prefill.launch_config = default
    return {key: timings}


def fastest(timings: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per shape key the config of least total time over the key's cases; configs that did not
    run every case are left out."""
    best = {}
    for key, by_config in timings.items():
        cases = set().union(*by_config.values())
        totals = {c: sum(t.values()) for c, t in by_config.items() if set(t) == cases}
        best[key] = json.loads(min(totals, key=totals.get))
    return best


def write_tuning(kernel: str, timings: dict[str, dict[str, dict]]) -> None:
    """The fastest configs into this GPU's entries of `kernel`'s table."""
    run = provenance(torch.device("cuda"))
    best = fastest(timings)
    source = f"benchmarks.attention_kernels --sweep at {run['commit']}, {run['date']}"
    print("wrote", tuning.write(kernel, run["device"], best, source))


def bench_fused():
    from backend.attention.kernels.rope import apply_rotary_
    from backend.kernels.rmsnorm import rms_norm
    from backend.layers.norm import RMSNorm
    from backend.layers.rotary import RotaryEmbedding, apply_rotary
    from backend.model_config import RopeConfig

    print("== fused kernels, 4096 tokens, bf16 (do_bench medians, us)")
    tokens, hidden = 4096, 4096
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm = RMSNorm(hidden, 1e-5).to("cuda", torch.bfloat16)
    weight = norm.weight.detach()
    out, new_res = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = norm(x, residual)
    print(
        f"  rmsnorm+residual max diff {(out.float() - ref_out.float()).abs().max().item():.3g}, "
        f"residual equal {torch.equal(new_res, ref_res)}"
    )
    t_kernel = do_bench(lambda: rms_norm(x, weight, 1e-5, residual), return_mode="median") * 1e3
    with torch.no_grad():
        t_torch = do_bench(lambda: norm(x, residual), return_mode="median") * 1e3
    print(f"  rmsnorm+residual hidden {hidden}: triton {t_kernel:.1f}  torch {t_torch:.1f}")
    heads, kv_heads, head_dim = 32, 8, 128
    rotary = RotaryEmbedding(RopeConfig(theta=500000.0), head_dim, 8192, 8192)
    rotary.build_cache("cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    qkv = torch.randn(
        tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16
    )
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cos, sin = rotary(positions, torch.bfloat16)
    ref_q, _ = apply_rotary(q.clone(), k.clone(), *rotary(positions, torch.float32))
    got_q, _ = apply_rotary_(q.clone(), k.clone(), rotary.cos_sin, positions)
    print(f"  rope max diff vs fp32 torch {(got_q.float() - ref_q.float()).abs().max().item():.3g}")
    t_kernel = (
        do_bench(lambda: apply_rotary_(q, k, rotary.cos_sin, positions), return_mode="median") * 1e3
    )
    t_torch = (
        do_bench(
            lambda: (rotary(positions, torch.bfloat16), apply_rotary(q, k, cos, sin)),
            return_mode="median",
        )
        * 1e3
    )
    print(
        f"  rope H={heads} KV={kv_heads} D={head_dim}: triton {t_kernel:.1f}  torch {t_torch:.1f}"
    )


def decode_table(scaled: bool = False) -> dict[str, dict]:
    """This GPU's decode-attention configs by shape key, as the kernel reads them now (for a
    quantized cache with `scaled`)."""
    decode_launch.launch_config.cache_clear()
    device = tuning.device_name(torch.device("cuda"))
    return {
        decode_launch.tuning_key(head_dim, few, scaled): dict(
            decode_launch.launch_config(head_dim, few, device, scaled)
        )
        for head_dim in (128, 64)
        for few in (False, True)
    }


def parse_shape(text: str) -> tuple[int, int]:
    """'512x192' -> (batch 512, context 192)."""
    batch, _, ctx = text.partition("x")
    return int(batch), int(ctx)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--sweep-splits",
        action="store_true",
        help="with --decode-only: every split count, the table's config only (is the heuristic's "
        "count the fastest?)",
    )
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--fused-only", action="store_true")
    parser.add_argument(
        "--decode-only",
        action="store_true",
        help="time decode alone, at --decode-shapes (default: the shapes below)",
    )
    parser.add_argument(
        "--decode-shapes",
        type=parse_shape,
        nargs="+",
        default=None,
        help="decode batches as BATCHxCONTEXT (e.g. 512x192), for both head sizes",
    )
    parser.add_argument(
        "--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="what the decode cache stores"
    )
    parser.add_argument("--json", default=None, help="with --decode-only: the decode timings")
    parser.add_argument(
        "--write-tuning",
        action="store_true",
        help="with --sweep: write the fastest configs into this GPU's tuning tables",
    )
    args = parser.parse_args()
    if args.write_tuning and not args.sweep:
        parser.error("--write-tuning needs --sweep")
    torch.manual_seed(0)
    print(
        torch.cuda.get_device_name(),
        "SMs",
        decode_launch.num_sms(torch.device("cuda")),
        "triton",
        triton.__version__,
    )
    if args.decode_only:
        decode_timings, rows = {}, []
        table_before = decode_table(args.kv_dtype != "bf16")
        for heads, kv_heads, head_dim in [(32, 8, 128), (32, 8, 64)]:
            setup = Setup(heads, kv_heads, head_dim, args.kv_dtype)
            shapes = args.decode_shapes or [(512, 192)]
            sweep = args.sweep or args.sweep_splits
            decode_timings |= bench_decode(setup, shapes, sweep, rows, not args.sweep_splits)
            del setup
            torch.cuda.empty_cache()
        if args.write_tuning:
            write_tuning("decode_attention", decode_timings)
        if args.json:  # what plot.py draws: each shape under the table before and after
            run = dict(benchmark="decode_attention_sweep", **provenance(torch.device("cuda")))
            after = decode_table(args.kv_dtype != "bf16")
            run.update(table_before=table_before, table_after=after, rows=rows)
            save_json(args.json, [run])
        return
    bench_fused()
    if args.fused_only:
        return
    big = Setup(32, 8, 128)  # Llama-3.1-8B attention
    if not args.skip_check:
        check_correctness(big)
    bench_kv_write(big)
    shapes = args.decode_shapes or [
        (1, 1024),
        (1, 8192),
        (4, 4096),
        (8, 2048),
        (16, 1024),
        (32, 1024),
        (32, 4096),
        (64, 2048),
        (128, 1024),
        (256, 1024),
    ]
    decode_timings = bench_decode(big, shapes, args.sweep)
    prefill_timings = bench_prefill(
        big,
        [(64, 64, 4, 4), (64, 32, 4, 3), (128, 32, 4, 2), (128, 64, 8, 3), (128, 64, 4, 3)],
        args.sweep,
    )
    del big
    torch.cuda.empty_cache()
    small = Setup(32, 8, 64)  # Llama-3.2-1B attention
    decode_timings |= bench_decode(
        small, args.decode_shapes or [(1, 4096), (16, 1024), (64, 2048), (256, 1024)], args.sweep
    )
    prefill_timings |= bench_prefill(
        small,
        [(128, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3)],
        args.sweep,
    )
    if args.write_tuning:
        write_tuning("decode_attention", decode_timings)
        write_tuning("prefill_attention", prefill_timings)


if __name__ == "__main__":
    main()

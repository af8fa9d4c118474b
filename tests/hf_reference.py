"""Greedy decoding with Hugging Face transformers: the ground truth the engine must match."""

from __future__ import annotations

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

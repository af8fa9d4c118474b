"""Per-request logits processors: embedding bias, bans and penalties.

These are the sparse, history-dependent edits a request makes to its row of logits before any
filtering or sampling. They touch few entries per row (a bias dict, a handful of banned ids, the
tokens seen so far), so the per-request work is done in Python to collect `(row, token, value)`
index lists, and each kind of edit is then applied to the whole batch with one indexed tensor
operation. Nothing here loops over the vocabulary.

Order (the same as TensorRT-LLM's and the one the sampler documents):

1. embedding bias        logit[t] += bias[t]
2. bad words ban         logit[t] = -inf for the last token of each banned sequence whose prefix
                         the output currently ends with (length-1 sequences: always)
3. min-tokens end ban    logit[end] = -inf for every end id while len(output) < min_tokens
                         (end ids: `sampling.end_id` if set, else the model's defaults; none with
                         `ignore_end_id`, because the end id then never finishes the request)
4. repetition penalty    over prompt + output tokens, once per distinct token (HF / TRT-LLM):
                         logit > 0 is divided by the penalty, otherwise multiplied by it
5. presence / frequency  over output tokens (OpenAI): logit -= presence + frequency * count
"""
from __future__ import annotations

from collections import Counter

import torch

from backend.request import Request
from backend.sampling_params import SamplingParams


def end_ids_for(params: SamplingParams, default_end_ids: list[int]) -> list[int]:
    """The ids that would end this request; -1 (or any id outside the vocab) means none."""
    if params.ignore_end_id:
        return []
    return [params.end_id] if params.end_id is not None else list(default_end_ids)


def has_processors(request: Request, default_end_ids: list[int]) -> bool:
    """Whether any processor would change this request's row at the current step."""
    p = request.sampling
    return bool(
        p.embedding_bias
        or p.bad_token_ids
        or (len(request.output_ids) < p.min_tokens and end_ids_for(p, default_end_ids))
        or p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
    )


def banned_token_ids(request: Request, default_end_ids: list[int]) -> list[int]:
    """Token ids that must not be produced at this step (bad words and min-tokens end ban)."""
    p = request.sampling
    out = request.output_ids
    banned = []
    for seq in p.bad_token_ids:
        prefix = seq[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix):
            banned.append(seq[-1])
    if len(out) < p.min_tokens:
        banned.extend(end_ids_for(p, default_end_ids))
    return banned


def apply_logits_processors(
    logits: torch.Tensor, requests: list[Request], default_end_ids: list[int]
) -> None:
    """Apply every processor of every request to `logits` [B, V] in place (row i = requests[i])."""
    vocab_size = logits.shape[1]
    device = logits.device

    def index(rows: list[int], cols: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(cols, dtype=torch.long, device=device))

    def values(vals: list[float]) -> torch.Tensor:
        return torch.tensor(vals, dtype=logits.dtype, device=device)

    # 1. Embedding bias (dict keys are distinct, so each entry is added exactly once).
    rows, cols, bias = [], [], []
    for i, r in enumerate(requests):
        for token, b in r.sampling.embedding_bias.items():
            rows.append(i), cols.append(token), bias.append(b)
    if rows:
        logits.index_put_(index(rows, cols), values(bias), accumulate=True)

    # 2 + 3. Bans. Ids outside the vocab (e.g. end_id = -1, "no end id") are ignored.
    rows, cols = [], []
    for i, r in enumerate(requests):
        for token in banned_token_ids(r, default_end_ids):
            if 0 <= token < vocab_size:
                rows.append(i), cols.append(token)
    if rows:
        logits.index_put_(index(rows, cols), values([float("-inf")]))

    # 4. Repetition penalty. Duplicated (row, token) pairs all compute the same new value from
    # the same gathered old value, so the write is idempotent: each token is penalised once.
    rows, cols, pen = [], [], []
    for i, r in enumerate(requests):
        penalty = r.sampling.repetition_penalty
        if penalty != 1.0:
            seen = set(r.prompt_ids)
            seen.update(r.output_ids)
            rows.extend([i] * len(seen)), cols.extend(seen), pen.extend([penalty] * len(seen))
    if rows:
        idx = index(rows, cols)
        old = logits[idx]
        penalty = values(pen)
        logits[idx] = torch.where(old > 0, old / penalty, old * penalty)

    # 5. Presence and frequency penalties over the output tokens.
    rows, cols, sub = [], [], []
    for i, r in enumerate(requests):
        p = r.sampling
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            for token, count in Counter(r.output_ids).items():
                rows.append(i), cols.append(token)
                sub.append(p.presence_penalty + p.frequency_penalty * count)
    if rows:
        logits.index_put_(index(rows, cols), -values(sub), accumulate=True)

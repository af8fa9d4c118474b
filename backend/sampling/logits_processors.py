"""Per-request logits processors: embedding bias, bans and penalties.

These are the sparse, history-dependent edits a request makes to its row of logits before any
filtering or sampling. They touch few entries per row (a bias dict, a handful of banned ids, the
tokens seen so far), so the per-request work is done in Python to collect `(row, token)` index
lists, and each kind of edit is then applied to the whole batch with one indexed tensor
operation. Nothing here loops over the vocabulary. Prompts can be long and never change, so
their distinct tokens are turned into a device tensor once per request (`PromptTokenCache`);
per step only the output tokens go through Python.

Order (the sampler documents the same):

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

import numpy as np
import torch

from backend.request import Request
from backend.sampling_params import SamplingParams
from backend.staging import to_device


def end_ids_for(params: SamplingParams, default_end_ids: list[int]) -> list[int]:
    """The ids that would end this request; -1 (or any id outside the vocab) means none."""
    if params.ignore_end_id:
        return []
    return [params.end_id] if params.end_id is not None else list(default_end_ids)


def min_tokens_end_ban(request: Request, default_end_ids: list[int]) -> list[int]:
    """The end ids the min-tokens ban takes from this request's row at the current step."""
    p = request.sampling
    return end_ids_for(p, default_end_ids) if request.num_output_tokens < p.min_tokens else []


def has_processors(
    request: Request, default_end_ids: list[int], end_ban_applied: bool = False
) -> bool:
    """Whether any processor would change this request's row at the current step
    (`end_ban_applied`: not counting a min-tokens end ban, which the argmax already skipped)."""
    p = request.sampling
    return bool(
        p.embedding_bias
        or p.bad_token_ids
        or (not end_ban_applied and min_tokens_end_ban(request, default_end_ids))
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
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix):
            banned.append(seq[-1])
    banned.extend(min_tokens_end_ban(request, default_end_ids))
    return banned


class PromptTokenCache:
    """Distinct prompt tokens of each request as a device tensor, built on first use.

    The owner (the sampler) drops an entry with `forget` when its request ends, so a request id
    may be reused. The prompt length is checked as a cheap guard against a stale entry.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._tokens: dict[str, tuple[int, torch.Tensor]] = {}

    def get(self, request: Request) -> torch.Tensor:
        entry = self._tokens.get(request.request_id)
        if entry is None or entry[0] != len(request.prompt_ids):
            # numpy converts a long list far faster than torch.tensor does.
            distinct = np.unique(np.asarray(request.prompt_ids, dtype=np.int64))
            entry = (len(request.prompt_ids), to_device(distinct, torch.long, self.device))
            self._tokens[request.request_id] = entry
        return entry[1]

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


def apply_logits_processors(
    logits: torch.Tensor,
    requests: list[Request],
    default_end_ids: list[int],
    prompt_cache: PromptTokenCache | None = None,
) -> None:
    """Apply every processor of every request to `logits` [B, V] in place (row i = requests[i]).

    Without a `prompt_cache` the prompts are converted afresh (fine for one-off calls).
    """
    vocab_size = logits.shape[1]
    device = logits.device
    prompt_cache = prompt_cache or PromptTokenCache(device)

    # 1. Embedding bias (dict keys are distinct, so each entry is added exactly once).
    rows, cols, bias = [], [], []
    for i, r in enumerate(requests):
        for token, b in r.sampling.embedding_bias.items():
            rows.append(i), cols.append(token), bias.append(b)
    if rows:
        bias_t = to_device(bias, logits.dtype, device)
        logits.index_put_(_index(rows, cols, device), bias_t, accumulate=True)

    # 2 + 3. Bans. Ids outside the vocab (e.g. end_id = -1, "no end id") are ignored.
    rows, cols = [], []
    for i, r in enumerate(requests):
        for token in banned_token_ids(r, default_end_ids):
            if 0 <= token < vocab_size:
                rows.append(i), cols.append(token)
    if rows:
        logits.index_put_(_index(rows, cols, device), logits.new_full((), float("-inf")))

    # 4. Repetition penalty over prompt + output. A token seen several times appears several
    # times in the index, but every copy computes the same new value from the same gathered old
    # value, so the write is idempotent and each token is penalised exactly once.
    penalised = [i for i, r in enumerate(requests) if r.sampling.repetition_penalty != 1.0]
    if penalised:
        rows_t, cols_t = _output_index(requests, penalised, device)
        prompts = [prompt_cache.get(requests[i]) for i in penalised]
        lengths = [t.numel() for t in prompts]
        prompt_rows = torch.repeat_interleave(
            to_device(penalised, torch.long, device),
            to_device(lengths, torch.long, device),
            output_size=sum(lengths),
        )
        idx = (torch.cat([prompt_rows, rows_t]), torch.cat([*prompts, cols_t]))
        penalty = _per_row(requests, lambda p: p.repetition_penalty, logits)[idx[0]]
        old = logits[idx]
        logits[idx] = torch.where(old > 0, old / penalty, old * penalty)

    # 5. Presence (once per distinct output token, idempotent as above), then frequency (once
    # per occurrence, accumulated).
    penalised = [
        i
        for i, r in enumerate(requests)
        if r.output_ids and (r.sampling.presence_penalty or r.sampling.frequency_penalty)
    ]
    if penalised:
        idx = _output_index(requests, penalised, device)
        presence = _per_row(requests, lambda p: p.presence_penalty, logits)[idx[0]]
        frequency = _per_row(requests, lambda p: p.frequency_penalty, logits)[idx[0]]
        logits[idx] = logits[idx] - presence
        logits.index_put_(idx, -frequency, accumulate=True)


def _index(rows: list[int], cols: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    both = to_device([rows, cols], torch.long, device)
    return both[0], both[1]


def _output_index(requests: list[Request], rows: list[int], device):
    """(row, token) for every output token of the given rows, duplicates included."""
    flat: list[int] = []
    row_ids: list[int] = []
    for i in rows:
        out = requests[i].output_ids
        flat += out
        row_ids += [i] * len(out)
    both = to_device(np.array([row_ids, flat], dtype=np.int64).reshape(2, -1), torch.long, device)
    return both[0], both[1]


def _per_row(requests: list[Request], value, like: torch.Tensor) -> torch.Tensor:
    """A [B] tensor holding value(sampling params) for every row."""
    return to_device([value(r.sampling) for r in requests], like.dtype, like.device)

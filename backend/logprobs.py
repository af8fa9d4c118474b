"""Log-probs beyond the chosen token's: the top-k of a position, and the prompt's log-probs.

All are taken under the raw model distribution (log_softmax of the unprocessed float32 logits),
as the sampler's chosen-token log-probs are, and every one is computed as logit - logsumexp(row):
the chosen token's log-prob therefore equals its entry among the top-k exactly.

Prompt log-probs: prompt token i's log-prob is read from the logits at position i - 1, so
position 0 has none (0.0, and an empty top-k). The logits of the last prompt position are the
first generated token's distribution: the sampler's, not a prompt log-prob. Only the requests that
ask get their prompt rows projected (`prompt_rows`), a slice of rows at a time, keeping only the
small results, so a long prompt never holds a [prompt, vocab] tensor. Positions are collected
once: a request recomputing its prompt after a preemption skips those it has. Prefix reuse would
skip positions, so such a request reuses no cached block until it has them all
(`KVCacheManager.match_prefix`); its own blocks are cached for others as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROWS_PER_SLICE = 256  # prompt rows projected to the vocabulary at once


def top_logprobs(
    logits: torch.Tensor, lse: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probs of each row of `logits` [N, V] (sorted, descending) and their
    ids; `lse` [N] is each row's logsumexp."""
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return values - lse[:, None], ids


@dataclass
class PromptLogprobs:
    """A request's prompt log-probs as its chunks compute them (tensors, possibly on the device,
    until `result`)."""

    num_prompt_tokens: int
    k: int  # num_top_log_probs
    num_done: int = 1  # prompt positions covered; position 0 has nothing to compute
    pieces: list[tuple] = field(default_factory=list)  # (log-probs [n], top values, top ids)

    @property
    def complete(self) -> bool:
        return self.num_done >= self.num_prompt_tokens

    def add(self, logprobs: torch.Tensor, top: tuple | None) -> None:
        self.pieces.append((logprobs, *(top or (None, None))))
        self.num_done += logprobs.shape[0]

    def result(self) -> tuple[list[float], list[list[int]] | None, list[list[float]] | None]:
        """(log-prob of each prompt token, top-k ids, top-k log-probs) as host lists, one entry
        per prompt position; position 0: 0.0 and empty top-k lists. Top-k: None when k is 0."""
        logprobs, ids, values = [0.0], [[]], [[]]
        for piece_logprobs, piece_values, piece_ids in self.pieces:
            logprobs += piece_logprobs.tolist()
            if self.k:
                values += piece_values.tolist()
                ids += piece_ids.tolist()
        return logprobs, (ids if self.k else None), (values if self.k else None)


@dataclass(slots=True)
class PromptRows:
    """Rows of a step's packed tokens whose logits give prompt log-probs of one request."""

    prompt: PromptLogprobs
    targets: list[int]  # the prompt tokens these rows predict, one per row
    first_row: int  # in the step's packed tokens


def prompt_rows(chunks, query_starts) -> list[PromptRows]:
    """The rows this step computes that give prompt log-probs not collected yet. `query_starts`:
    each chunk's first row in the packed tokens."""
    rows = []
    for chunk, first in zip(chunks, query_starts):
        request = chunk.request
        prompt = request.prompt_logprobs
        if prompt is None or prompt.complete:
            continue
        # Row at position p predicts token p + 1; the last prompt position predicts an output.
        lo = prompt.num_done - 1
        hi = min(chunk.start + chunk.num_tokens, prompt.num_prompt_tokens - 1)
        if lo < chunk.start:
            raise RuntimeError(
                f"request {request.request_id}: prompt log-probs from position {lo} needed, but "
                f"the step starts at {chunk.start} (were cached blocks reused?)"
            )
        if hi > lo:
            rows.append(
                PromptRows(
                    prompt, request.prompt_ids[lo + 1 : hi + 1], int(first) + lo - chunk.start
                )
            )
    return rows


def compute_prompt_logprobs(
    compute_logits, hidden: torch.Tensor, rows: list[PromptRows]
) -> list[tuple[PromptLogprobs, torch.Tensor, tuple | None]]:
    """For each of `rows`: the log-probs of its targets and, with k > 0, the top-k of its rows,
    from `compute_logits(hidden rows)`; a slice of rows at a time."""
    results = []
    for r in rows:
        targets = torch.tensor(r.targets, dtype=torch.long, device=hidden.device)
        k = r.prompt.k
        logprobs, values, ids = [], [], []
        for s in range(0, len(r.targets), ROWS_PER_SLICE):
            e = min(s + ROWS_PER_SLICE, len(r.targets))
            logits = compute_logits(hidden[r.first_row + s : r.first_row + e]).float()
            lse = torch.logsumexp(logits, dim=-1)
            logprobs.append(logits.gather(1, targets[s:e, None]).squeeze(1) - lse)
            if k:
                top_values, top_ids = top_logprobs(logits, lse, k)
                values.append(top_values)
                ids.append(top_ids)
            del logits
        top = (torch.cat(values), torch.cat(ids)) if k else None
        results.append((r.prompt, torch.cat(logprobs), top))
    return results

"""Which requests may be speculated, and greedy verification of their drafts.

Greedy verification is exact: the target model computes its argmax at the request's last token
and at every draft in one step; the drafts equal to the target's argmax at their position are
accepted in order, up to the first that is not, and the target's own token at that position (or
after the last draft, when all were accepted) follows them. The output is therefore the tokens
that greedy decoding without drafts would produce, one to d + 1 of them a step.
"""

from __future__ import annotations

from backend.request import Request


def may_speculate(request: Request) -> bool:
    """Whether drafts for this request can be verified exactly by the greedy rule: greedy, and
    nothing whose value at a draft's position depends on the tokens before it that the batched
    rows would not see (penalties, bad words, an end ban still under min_tokens), and no
    log-probs (computed for one row per request). Embedding bias applies to every row alike."""
    p = request.sampling
    return (
        p.greedy
        and not p.return_log_probs
        and not p.num_top_log_probs
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and not p.bad_token_ids
        and request.num_output_tokens >= p.min_tokens
    )


def accepted_tokens(draft_ids: list[int], target_ids: list[int]) -> tuple[list[int], int]:
    """(the tokens a verified step produces, how many drafts were accepted). `target_ids`: the
    target's token at the last real token and at each draft (len(draft_ids) + 1 of them)."""
    accepted = 0
    for draft, target in zip(draft_ids, target_ids):
        if draft != target:
            break
        accepted += 1
    return target_ids[: accepted + 1], accepted

"""When a request stops, and which of its tokens may be delivered yet.

Stop sequences are matched on token ids after every step. A matched stop sequence is not delivered
(the text ends where the stop word starts). Tokens that could still become a stop sequence are held
back until the next token decides, so a streamed stop word never leaks its first pieces.
"""

from __future__ import annotations

from backend.request import FinishReason, Request


def matched_stop_length(output_ids: list[int], stop_sequences: list[list[int]]) -> int:
    """Length of the longest stop sequence that `output_ids` ends with, 0 if none."""
    best = 0
    for stop in stop_sequences:
        n = len(stop)
        if n > best and n <= len(output_ids) and output_ids[-n:] == stop:
            best = n
    return best


def held_back_length(output_ids: list[int], stop_sequences: list[list[int]]) -> int:
    """Longest suffix of `output_ids` that is a proper prefix of some stop sequence."""
    best = 0
    for stop in stop_sequences:
        for n in range(min(len(stop) - 1, len(output_ids)), best, -1):
            if output_ids[-n:] == stop[:n]:
                best = n
                break
    return best


def check_finish(request: Request, end_ids, max_seq_len: int) -> tuple[FinishReason | None, int]:
    """Decide after a token was appended: (finish reason or None, number of deliverable tokens).

    `end_ids` is any container (a frozenset is fastest). Runs for every request every step, so
    a request without stop sequences skips the suffix matching altogether.
    """
    output = request.output_ids
    n = len(output)
    params = request.sampling
    stops = params.stop_token_ids
    if stops:
        stop_len = matched_stop_length(output, stops)
        if stop_len:
            return FinishReason.STOP, n - stop_len
    if not params.ignore_end_id and n and output[-1] in end_ids:
        return FinishReason.END_ID, n - 1
    if n >= params.max_tokens or len(request.prompt_ids) + n >= max_seq_len:
        return FinishReason.LENGTH, n
    if stops:
        return None, n - held_back_length(output, stops)
    return None, n

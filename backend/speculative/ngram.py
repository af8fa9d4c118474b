"""N-gram drafting (prompt lookup): the tokens that followed an earlier occurrence of the
request's last tokens.

For n from `max_n` down to `min_n`, the request's last n tokens (prompt and outputs) are looked up
among its earlier tokens; at the first (earliest) earlier occurrence of the longest n that has
one, the up-to-k tokens that followed it are the drafts. The earliest occurrence has the most
tokens after it, so a repeating pattern yields all k drafts. No model runs: it costs a scan of the
request's tokens, and pays on text that copies from its context (summaries, code edits, loops).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, k: int):
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and k >= 1, got {min_n}, {max_n}, {k}")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to min(k, limit) drafts to follow `token_ids`; [] when no suffix n-gram occurred
        before."""
        k = self.k if limit is None else min(self.k, limit)
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that end before the last token: each leaves at least one token to copy.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start : start + k].tolist()
        return []

"""OpenAI's `stop` on text: the output ends before the stop string that begins first, which is not
returned (however the text is split into pieces).

Streamed text is held back while it ends with the beginning of a stop string, so a stop string
never leaks its first characters into a delta and the deltas concatenate to the unstreamed text.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""  # text received but not released: it may begin a stop string
        self.matched = False

    def feed(self, text: str, final: bool = False) -> str:
        """The text that may be released after `text` arrived; nothing once a stop matched."""
        if self.matched:
            return ""
        if not self.stops:
            return text
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            start = cut if final else self._partial_start(cut)
            if start < cut:  # a stop string beginning earlier may still complete: wait for it
                released, self.pending = self.pending[:start], self.pending[start:]
                return released
            self.matched = True
            released, self.pending = self.pending[:cut], ""
            return released
        held = 0 if final else self._partial_match_length()
        released = self.pending[: len(self.pending) - held]
        self.pending = self.pending[len(self.pending) - held :]
        return released

    def _partial_start(self, cut: int) -> int:
        """The first position before `cut` where the rest of `pending` begins a stop string,
        else `cut`."""
        for start in range(cut):
            rest = self.pending[start:]
            if any(len(stop) > len(rest) and stop.startswith(rest) for stop in self.stops):
                return start
        return cut

    def _partial_match_length(self) -> int:
        """Length of the longest end of `pending` that is a proper beginning of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best

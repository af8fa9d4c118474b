"""Waiting in tests: a condition polled until a deadline, so that a hang fails naming what it
waited for instead of hanging the run."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object], what: str, timeout_s: float = 60.0, poll_s: float = 0.01
) -> None:
    """Poll `condition()` until it is true; fail naming `what` once `timeout_s` has passed.
    `poll_s` 0 only yields between polls (for a moment that passes quickly, such as a first
    token before a request of a few hundred tokens ends)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(poll_s)

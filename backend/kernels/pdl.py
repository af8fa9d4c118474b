"""Programmatic dependent launch (PDL, Hopper and later) for chains of small kernels, and the rule
that keeps it from racing with a step's inputs.

A decode step at small batch is ~100 short kernels back to back; between two of them the GPU
drains one grid and ramps up the next. Launched with PDL, a kernel may start while the previous one
is still finishing: its programs wait (`gdc_wait`) for the previous grid's completion, and its
memory, before they read what it wrote or write anything, and signal (`gdc_launch_dependents`)
when the next kernel may begin launching. Kernels take a `PDL` constexpr and launch with
`**launch_options(ORDERING)`; without PDL (older GPUs, the CPU interpreter) both calls compile away.

The rule. Some kernels read step inputs (positions, cache slots, context lengths, block tables)
before their wait, to overlap those reads with the previous kernel. That is only safe if the
kernel cannot start before the step inputs were written; in a decode CUDA graph a kernel writes
them (`backend.kernels.step_inputs`), and a kernel that released its dependents before its own
wait once let the first layer read positions and slots before they were there. So every PDL
launch declares its `Ordering`, and `check_step_input_reads` proves, for a recorded sequence of
launches (`recorded_launches`), that no kernel reading step inputs before its wait can start before
the last step-input writer has finished.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 (kernels use them)

RELEASES = ("before_wait", "after_wait", "at_end")


@dataclass(frozen=True)
class Ordering:
    """How one kernel orders itself against the kernels around it."""

    kernel: str
    releases: str  # when its dependents may launch: one of RELEASES
    reads_step_inputs_before_wait: bool = False
    writes_step_inputs: bool = False
    pdl: bool = True  # launched with PDL: may start before its predecessor ends

    def __post_init__(self):
        assert self.releases in RELEASES, self.releases


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


_recorded: list[Ordering] | None = None


def record(ordering: Ordering) -> None:
    """Note a launch while `recorded_launches` is active (for kernels launched without PDL)."""
    if _recorded is not None:
        _recorded.append(ordering)


def launch_options(ordering: Ordering) -> dict:
    """Launch keyword arguments of a kernel declared by `ordering`: the PDL constexpr, and the
    launch attribute where supported."""
    if _recorded is not None:
        _recorded.append(ordering)
    return {"PDL": True, "launch_pdl": True} if enabled() else {"PDL": False}


@contextmanager
def recorded_launches() -> Iterator[list[Ordering]]:
    """The orderings of the kernels launched inside the block, in launch order."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


class StepInputRace(AssertionError):
    pass


def check_step_input_reads(launches: list[Ordering]) -> None:
    """Raise StepInputRace where a kernel that reads step inputs before its wait may start before
    the last step-input writer launched ahead of it has finished, with PDL on.

    Launch i may start once launch i-1 lets it: at i-1's end (no PDL on i, or i-1 releases at
    its end), once i-1 has waited (then launch i-2 has finished), or, when i-1 releases before
    its wait, as early as i-1 itself could start. Launches not recorded (torch's) start only
    after their predecessor ends and end before their successor starts, so leaving them out
    only makes the check stricter."""
    finished: list[int] = []  # [i]: launches 0..finished[i] have finished when launch i starts
    writer = -1
    for i, kernel in enumerate(launches):
        previous = launches[i - 1] if i else None
        if previous is None or not kernel.pdl or previous.releases == "at_end":
            done = i - 1
        elif previous.releases == "after_wait":
            done = i - 2
        else:
            done = finished[i - 1]
        finished.append(done)
        if kernel.reads_step_inputs_before_wait and writer > done:
            raise StepInputRace(
                f"launch {i} ({kernel.kernel}) reads step inputs before its wait but may start "
                f"before launch {writer} ({launches[writer].kernel}) has written them: a kernel "
                f"between them releases its dependents before it has waited"
            )
        if kernel.writes_step_inputs:
            writer = i


__all__ = [
    "Ordering",
    "StepInputRace",
    "check_step_input_reads",
    "enabled",
    "gdc_launch_dependents",
    "gdc_wait",
    "launch_options",
    "record",
    "recorded_launches",
]

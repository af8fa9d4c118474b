"""A sampling profile of a process while a load runs (py-spy, where installed): which Python
lines each thread of the engine spends its time on, for finding the host work that paces steps.
Optional: without py-spy the loads run unprofiled."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

RATE_HZ = 200


def engine_process_pid() -> int | None:
    """The newest engine process on this host (started by the LLM model's stub)."""
    found = subprocess.run(
        ["pgrep", "-n", "-f", "backend.process.service"], capture_output=True, text=True
    )
    return int(found.stdout.split()[0]) if found.stdout.strip() else None


@contextlib.contextmanager
def sampled_profile(pid: int | None, out: Path | None):
    """Record `pid` into `out` (collapsed stacks, one file per load) while the block runs."""
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if out is None or pid is None or spy is None:
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [spy, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--threads"]
    command += ["--nonblocking", "--format", "raw", "--output", str(out)]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            recorder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            recorder.kill()

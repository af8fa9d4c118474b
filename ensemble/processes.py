"""The process tree of a served repository, seen from the launcher: tritonserver, one stub per
model instance, the engine process under the LLM's stub, and the shared memory they map.

Used to drain the engines before a shutdown, and to clean up after a server that was killed
(a killed server cannot remove its shared-memory regions; its stubs may outlive it briefly).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

SHM_DIR, SHM_PATTERN = Path("/dev/shm"), "triton_python_backend_shm_region_*"


def engine_processes(server_pid: int) -> list[int]:
    """The engine processes started by the server's models (descendants running
    backend.process.service)."""
    return [pid for pid in descendants(server_pid) if b"backend.process.service" in cmdline(pid)]


def cmdline(pid: int) -> bytes:
    """A process's arguments separated by NULs; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def descendants(pid: int) -> list[int]:
    """Children, their children, and so on."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def remove_orphan_shm_regions(before: set[Path]) -> None:
    """Remove the Python backend's shared-memory regions created since `before` that no process
    maps any more (a killed server cannot remove its own)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(
                line.split()[-1]
                for line in maps.read_text().splitlines()
                if "triton_python_backend_shm_region" in line
            )
        except OSError:
            continue
    for region in set(SHM_DIR.glob(SHM_PATTERN)) - before:
        if str(region) not in mapped:
            region.unlink(missing_ok=True)


def wait_group_gone(pgid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def send_signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def with_parent(command: list[str]) -> list[str]:
    """`command`, run so that it gets SIGTERM when this process dies, however it dies.

    Through a small launcher rather than a `preexec_fn`: Python code in the child of a fork of a
    threaded process (gRPC clients, torch, a test runner) can deadlock or crash, and without a
    `preexec_fn` subprocess starts the child without running fork handlers at all."""
    return [sys.executable, "-m", "ensemble.processes", str(os.getpid()), *command]


def _exec_with_parent(parent: int, command: list[str]) -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the signal was asked for
        sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    _exec_with_parent(int(sys.argv[1]), sys.argv[2:])

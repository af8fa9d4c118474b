"""A command started through `with_parent` runs as given and ends when the process that started
it dies, however that one dies (here: SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ensemble.build import PROJECT_ROOT

LAUNCHER = """
import subprocess, sys, time
from ensemble.processes import with_parent
child = subprocess.Popen(with_parent(["sleep", "60"]))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_the_command_ends_with_the_process_that_started_it():
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, cwd=PROJECT_ROOT, text=True
    )
    child = int(launcher.stdout.readline())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}/cmdline").read_bytes() != b"sleep\x0060\x00":  # after its exec
        assert time.monotonic() < deadline, "the command was not started as given"
        time.sleep(0.05)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the command outlived the process that started it"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended (its parent, now init, reaps it)


def test_a_system_tritonserver_install_is_found_and_its_backends_used(tmp_path, monkeypatch):
    """TRITONSERVER_ROOT (or /opt/tritonserver in NVIDIA's containers, where no pytriton wheel
    is installed) names a system install: its binary, its own backends directory (the stub built
    for the Python beside it), its lib/; a missing part is named."""
    from ensemble.server import TritonServer
    from ensemble.triton_install import locate_tritonserver, prepare_backends

    root = tmp_path / "tritonserver"
    for part in ("bin/tritonserver", "backends/python/triton_python_backend_stub"):
        (root / part).parent.mkdir(parents=True, exist_ok=True)
        (root / part).write_bytes(b"")
    monkeypatch.setenv("TRITONSERVER_ROOT", str(root))
    install = locate_tritonserver()
    assert install.system and install.binary == root / "bin" / "tritonserver"
    assert install.libs == root / "lib"
    backends = prepare_backends(install)
    assert backends == root / "backends"
    command = TritonServer(tmp_path / "repo").command(install, backends)
    assert command[0] == str(root / "bin" / "tritonserver")
    assert f"--backend-directory={root / 'backends'}" in command
    (root / "backends/python/triton_python_backend_stub").unlink()
    with pytest.raises(RuntimeError, match="triton_python_backend_stub is missing"):
        locate_tritonserver()

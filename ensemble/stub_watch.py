"""Tie a model's stub process and tritonserver together, both ways.

- The stub dies (killed, out of memory, a crash in native code) while the server lives: Triton
  2.51 neither restarts a decoupled model's stub nor fails its requests, and keeps answering
  ready, so clients hang and no orchestrator notices. The watcher then stops the server (SIGTERM,
  then SIGKILL after a grace period): clients get errors at once, the server exits non-zero and a
  supervisor (`ensemble serve`'s caller, Kubernetes, systemd) restarts it.
- The server dies abruptly: the watcher kills the stub, which could otherwise live on as an
  orphan holding the model (a thread blocked on the dead server holds the GIL, so the stub's own
  parent check never runs).

A model starts its watcher in initialize() and dismisses it when finalize() is done, so an unload
or a normal shutdown is not taken for a death, while a finalize() that hangs on a server that
exited meanwhile still ends with the stub killed. The watcher is a shell loop in a session of
its own: it costs no Python interpreter and survives the signals sent to the stub's process group.
"""

from __future__ import annotations

import os
import subprocess

GRACE_S = 3  # from SIGTERM to SIGKILL of a server whose stub died

_SCRIPT = """
alive() { [ -d /proc/$1 ] && ! grep -q '^State:[[:space:]]*Z' /proc/$1/status 2>/dev/null; }
while alive $SERVER && alive $STUB; do sleep 1; done
if alive $SERVER; then
  echo "model $MODEL: its Triton Python backend stub (pid $STUB) died; stopping tritonserver \
(pid $SERVER) so that clients get errors and a supervisor restarts it" >&2
  kill -TERM $SERVER 2>/dev/null; sleep $GRACE; kill -KILL $SERVER 2>/dev/null
else
  kill -KILL $STUB 2>/dev/null
fi
"""


def watch_stub(model: str, grace_s: int = GRACE_S) -> subprocess.Popen | None:
    """Start the watcher of this stub (the calling process) and its server (the parent); None
    when the parent is not a tritonserver (never stop a process we do not know)."""
    try:
        with open(f"/proc/{os.getppid()}/comm") as comm:
            if comm.read().strip() != "tritonserver":
                return None
    except OSError:
        return None
    env = {
        "SERVER": str(os.getppid()),
        "STUB": str(os.getpid()),
        "MODEL": model,
        "GRACE": str(grace_s),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    }
    return subprocess.Popen(
        ["sh", "-c", _SCRIPT],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def dismiss(watcher: subprocess.Popen | None) -> None:
    """The stub is stopping on purpose: end its watcher first."""
    if watcher is not None and watcher.poll() is None:
        watcher.kill()
        watcher.wait()

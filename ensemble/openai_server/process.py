"""The front end as a child of `python -m ensemble serve`: started once tritonserver is ready,
stopped before it (no new requests while the engines drain), and its death stops the server, as a
stub's does (see ensemble/stub_watch.py), so that a supervisor restarts the whole replica."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ensemble.processes import with_parent

PROJECT_ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 10.0


@dataclass
class FrontEndProcess:
    port: int
    grpc_port: int
    metrics_port: int
    model: str
    tokenizer_dir: str | None = None
    served_model_name: str | None = None
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://localhost:{self.port}/v1"

    def command(self) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "ensemble.openai_server",
            f"--triton-url=localhost:{self.grpc_port}",
            f"--metrics-url=http://localhost:{self.metrics_port}/metrics"
            if self.metrics_port
            else "--metrics-url=",
            f"--port={self.port}",
            f"--model={self.model}",
        ]
        if self.tokenizer_dir:
            command.append(f"--tokenizer-dir={self.tokenizer_dir}")
        if self.served_model_name:
            command.append(f"--served-model-name={self.served_model_name}")
        return command

    def start(self) -> "FrontEndProcess":
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p
        )
        # Its own session: a Ctrl-C reaches the launcher alone, which drains the engines before
        # it stops this (streams then end with an error event and [DONE], not cut).
        self.process = subprocess.Popen(
            with_parent(self.command()), env=env, cwd=PROJECT_ROOT, start_new_session=True
        )
        return self

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # aiohttp closes its connections and exits
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

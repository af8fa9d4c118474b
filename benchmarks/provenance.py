"""Where and when a benchmark ran: device kind, date, commit. Every committed result carries it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

import torch


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU: {cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def git_commit() -> str:
    """HEAD of this checkout; GIT_COMMIT overrides it where the tree travels without .git."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tree_clean() -> bool | None:
    """Whether the checkout had no uncommitted changes (GIT_TREE_CLEAN=0|1 overrides it where the
    tree travels without .git); None where git cannot tell."""
    if os.environ.get("GIT_TREE_CLEAN") in ("0", "1"):
        return os.environ["GIT_TREE_CLEAN"] == "1"
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return not out.strip()


def provenance(device) -> dict:
    return {
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "tree_clean": tree_clean(),
        "torch": torch.__version__,
    }


def save_json(path: str | None, data) -> None:
    """Write a result file (indented, newline-terminated); no-op without a path."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")

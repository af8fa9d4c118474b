"""`python -m ensemble.perf_analyzer` (the README points to its --help) answers as a CLI should."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ensemble.perf_analyzer", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_0_and_names_the_commands(flag):
    result = _cli(flag)
    assert result.returncode == 0, result.stderr
    for command in ("perf_analyzer setup", "perf_analyzer run", "perf_analyzer env"):
        assert command in result.stdout


@pytest.mark.parametrize("args", [(), ("frobnicate",)])
def test_unknown_or_missing_command_is_a_usage_error(args):
    result = _cli(*args)
    assert result.returncode == 2
    assert "perf_analyzer setup" in result.stderr and not result.stdout

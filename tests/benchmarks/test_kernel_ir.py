"""The compiler's view of a kernel for a Hopper GPU, without one: the one-token GEMV with whole
rows prefetched (the H100 table's e4m3 gate|up config) compiles for sm_90, streams its weights
with vector loads, and converts no weight tile between layouts (K_LOOP: no loop, no second
layout to match). In a process of its own: the tests run the kernels under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_prefetched_gemv_weights_keep_their_layout(tmp_path):
    out = tmp_path / "ir.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    config = ["--block-n", "8", "--block-k", "512", "--prefetch-k", "2048", "--warps", "4"]
    command = [sys.executable, "-m", "benchmarks.kernel_ir", "gemv", "--weight", "e4m3"]
    command += ["--prologue", "norm", *config, "--json", str(out)]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["opcodes"]["LDG"] > 0 and result["opcodes"]["FFMA"] > 0
    weight_tile = "tensor<8x2048xf8E4M3FN"
    assert result["conversions"] and not any(weight_tile in c for c in result["conversions"])

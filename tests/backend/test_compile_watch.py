"""The compile watch reports a kernel compiled after the warm-up in the words the serving
benchmark reads back from a server log. Triton compiles nothing on a CPU (the interpreter runs
the kernels), so the hooks are called here as Triton calls them, with the key of either form
Triton versions give; tests/gpu checks that a real compile reaches them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from backend import compile_watch
from benchmarks.serving import logged_compiles

PARAMS = ["query_ptr", "num_splits", "stride_bt", "SPLITS_PAD"]


@pytest.mark.parametrize(
    "specs",
    [
        ("*bf16:16", "i32", "i32:16", "constexpr"),  # Triton 3.9
        (("*bf16", "D"), ("i32", ""), ("i32", "D"), ("constexpr", 8)),  # Triton 3.6
    ],
)
def test_a_compile_is_kept_logged_and_read_back(tmp_path, caplog, specs):
    params = [SimpleNamespace(name=n) for n in PARAMS]
    fn = SimpleNamespace(name="_decode_kernel", jit_function=SimpleNamespace(params=params))
    key = ("cuda", specs, "options")
    before = len(compile_watch.compiles())
    with caplog.at_level(logging.WARNING, logger="backend.compile_watch"):
        assert compile_watch._before_compile(key=key, fn=fn) is False
        compile_watch._after_compile(key=key, fn=fn, compile={"constants": {(3,): 8}})
    [event] = compile_watch.compiles()[before:]
    assert event.kernel == "_decode_kernel" and event.seconds >= 0
    assert event.specialization == (
        "num_splits: i32, stride_bt: i32:"
        + ("16" if specs[0] == "*bf16:16" else "D")
        + "; constants {'SPLITS_PAD': 8}"
    )
    log = tmp_path / "server.log"
    log.write_text("engine WARNING backend.compile_watch: " + caplog.records[-1].getMessage())
    assert logged_compiles(log) == [f"_decode_kernel {event.seconds:.2f} s"]

"""The compile watch reports a kernel compiled after the warm-up in the words the serving
benchmark reads back from a server log. Triton compiles nothing on a CPU (the interpreter runs
the kernels), so the hooks are called here as Triton calls them; tests/gpu checks that a real
compile reaches them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from backend import compile_watch
from benchmarks.serving import logged_compiles

REPR = (
    "_decode_kernel[num_warps=4, num_ctas=1, num_stages=2, enable_fp_fusion=True, "
    "launch_cooperative_grid=False](query_ptr: *bf16:16, num_splits: i32, stride_bt: i32:16)"
)


def test_a_compile_is_kept_logged_and_read_back(tmp_path, caplog):
    fn = SimpleNamespace(name="_decode_kernel")
    key = ("specialization", ("*bf16:16", "i32", "i32:16"))
    before = len(compile_watch.compiles())
    with caplog.at_level(logging.WARNING, logger="backend.compile_watch"):
        assert compile_watch._before_compile(key=key, fn=fn, repr=REPR) is False
        compile_watch._after_compile(
            key=key, repr=REPR, fn=fn, compile={"constants": {"SPLITS_PAD": 8}}
        )
    [event] = compile_watch.compiles()[before:]
    assert event.kernel == "_decode_kernel" and event.seconds >= 0
    assert event.specialization == (
        "num_splits: i32, stride_bt: i32:16; constants {'SPLITS_PAD': 8}"
    )
    log = tmp_path / "server.log"
    log.write_text("engine WARNING backend.compile_watch: " + caplog.records[-1].getMessage())
    assert logged_compiles(log) == [f"_decode_kernel {event.seconds:.2f} s"]

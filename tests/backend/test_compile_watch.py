"""The compile watch reports a kernel compiled after the warm-up in the words the serving
benchmark reads back from a server log. Triton compiles nothing on a CPU (the interpreter runs
the kernels), so the hooks are called here as Triton calls them; tests/gpu checks that a real
compile reaches them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from backend.runner import compile_watch
from benchmarks.serving import logged_compiles


def test_a_compile_is_kept_logged_and_read_back(tmp_path, caplog):
    fn = SimpleNamespace(name="_decode_kernel")
    key = "[('*bf16', 'D'), ('i32', ''), ('i32', 'D')]"
    compile = {
        "signature": {
            "query_ptr": "*bf16",
            "num_splits": "i32",
            "stride_bt": "i32",
            "num_seqs": "constexpr",
            "SPLITS_PAD": "constexpr",
        },
        "constants": {(3,): 1, (4,): 8},
    }
    before = len(compile_watch.compiles())
    with caplog.at_level(logging.WARNING, logger="backend.runner.compile_watch"):
        assert compile_watch._before_compile(key=key, fn=fn) is False
        compile_watch._after_compile(key=key, fn=fn, compile=compile)
    [event] = compile_watch.compiles()[before:]
    assert event.kernel == "_decode_kernel" and event.seconds >= 0
    assert event.specialization == (
        "num_splits: i32, stride_bt: i32; constants {'num_seqs': 1, 'SPLITS_PAD': 8}"
    )
    log = tmp_path / "server.log"
    log.write_text(
        "engine WARNING backend.runner.compile_watch: " + caplog.records[-1].getMessage()
    )
    assert logged_compiles(log) == [f"_decode_kernel {event.seconds:.2f} s"]

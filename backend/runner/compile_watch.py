"""Kernel compiles after the warm-up, made visible.

A Triton kernel is compiled for each combination of its compile-time constants and of what it
specialises its integer arguments on (equal to 1, divisible by 16). A step that meets a
combination the warm-up did not waits for the compile (seconds on a machine whose kernel cache
is empty), and every request in the step waits with it. After `watch()` each such compile is
logged as a warning naming the kernel, its specialisation and the time it took, and kept in
`compiles()`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelCompile:
    kernel: str
    seconds: float  # compiling, or loading from Triton's disk cache (milliseconds)
    specialization: str  # the argument types and the constants it was built for


_lock = threading.Lock()
_compiles: list[KernelCompile] = []
_started: dict[tuple[str, str], float] = {}


def watch() -> bool:
    """Start watching (for the whole process); False where this Triton offers no compile hooks."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    runtime.jit_cache_hook = _before_compile
    runtime.jit_post_compile_hook = _after_compile
    return True


def compiles() -> list[KernelCompile]:
    with _lock:
        return list(_compiles)


def _before_compile(*, key, fn, **_) -> bool:
    with _lock:
        _started[(fn.name, str(key))] = time.perf_counter()
    return False  # False: compile as usual


def _after_compile(*, key, fn, compile, **_) -> None:
    with _lock:
        began = _started.pop((fn.name, str(key)), None)
        seconds = time.perf_counter() - began if began is not None else 0.0
        event = KernelCompile(fn.name, seconds, _specialization(compile))
        _compiles.append(event)
    log.warning(
        "kernel %s compiled after the warm-up (%.2f s; the step waited): %s",
        event.kernel,
        event.seconds,
        event.specialization,
    )


def _specialization(compile: dict) -> str:
    """What the compile was for: the type of each argument that is not a pointer, then the
    constants (compile-time arguments, and integers specialised as equal to 1) by name."""
    signature = compile.get("signature") or {}
    names = list(signature)
    kept = [
        f"{name}: {kind}"
        for name, kind in signature.items()
        if isinstance(kind, str) and not kind.startswith("*") and kind != "constexpr"
    ]
    constants = {
        (names[k[0]] if isinstance(k, tuple) and k and k[0] < len(names) else k): v
        for k, v in (compile.get("constants") or {}).items()
    }
    return ", ".join(kept) + (f"; constants {constants}" if constants else "")

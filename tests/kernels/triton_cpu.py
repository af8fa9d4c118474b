"""Run Triton kernels in tests: compiled on a GPU, else in Triton's interpreter on CPU.

Import this before any module that defines kernels: it sets TRITON_INTERPRET=1 when there is no
GPU, so kernels decorated afterwards are interpreted. Test modules add
`pytestmark = pytest.mark.usefixtures("interpretable_triton_language")`.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def interpretable_triton_language():
    """Let interpreted kernels call triton.language's own @jit helpers (tl.max, tl.sum, tl.cdiv).

    When another module imported triton before TRITON_INTERPRET was set (transformers does, via
    the shared conftest), those helpers were decorated for compilation and refuse to run in the
    interpreter. Wrap them as interpreted functions for one test module, then restore them.
    """
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    compiled = {name: fn for name, fn in vars(tl).items() if isinstance(fn, JITFunction)}
    if DEVICE == "cuda" or not compiled:
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction

    for name, fn in compiled.items():
        setattr(tl, name, InterpretedFunction(fn.fn))
    yield
    for name, fn in compiled.items():
        setattr(tl, name, fn)

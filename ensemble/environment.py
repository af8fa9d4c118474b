"""The Python environments of a served repository: the stubs' and the engine's.

Triton runs each Python model in a stub process that embeds the Python of the environment it
is started from. The stub of tritonserver 2.51 (the `nvidia-pytriton==0.7.0` wheel) is built
against numpy 1.x: under numpy 2 it reads every input tensor wrong (a BYTES input fails its
first request with "unpack_from requires a buffer of at least ... bytes"; numbers arrive with
zero strides). So the stubs need numpy < 2, while the engine may need a GPU host's own stack
(torch, CUDA, numpy 2). The engine runs in a process of its own (backend/process/client.py), so
the two can differ:

- where the launching Python has numpy < 2 (the project's .venv), stubs and engine share it;
- otherwise the stubs run in a serving environment: a virtual environment holding numpy < 2,
  that sees the launching environment's packages through a `.pth` file (so transformers and
  tokenizers come from there, numpy from the serving environment), made once under the cache
  with pip (which honours PIP_FIND_LINKS / PIP_NO_INDEX for a host without network); the
  engine runs under the launching Python ($TRITONLLM_ENGINE_PYTHON).

`check_stub_numpy()` runs inside every stub (each model's initialize()), so a repository started
by hand under numpy 2 fails to load with the fix in its message instead of failing requests.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from backend.loading.disk_cache import cache_root

STUB_NUMPY_RULE = "numpy<2"


def stub_numpy_problem(version: str) -> str | None:
    """Why a stub cannot run with numpy `version`, or None when it can."""
    if int(version.split(".")[0]) < 2:
        return None
    return (
        f"tritonserver 2.51's Python backend stub reads tensors through numpy 1.x, and this "
        f"environment has numpy {version}: every request would fail. Install '{STUB_NUMPY_RULE}' "
        "in the environment that starts tritonserver (`make serve` uses .venv, which has it), "
        "or start it with `python -m ensemble serve`, which makes a serving environment with "
        "numpy < 2 beside a numpy 2 stack"
    )


def check_stub_numpy() -> None:
    """Inside a stub: refuse to load a model under a numpy the stub cannot read."""
    import numpy

    problem = stub_numpy_problem(numpy.__version__)
    if problem:
        raise RuntimeError(problem)


@dataclass(frozen=True)
class StubEnvironment:
    prefix: Path  # a Python environment: bin/python3, site-packages

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python3"


def stub_environment(log=print) -> StubEnvironment:
    """This environment when its numpy suits the stubs; else the serving environment (made once)."""
    import numpy

    if stub_numpy_problem(numpy.__version__) is None:
        return StubEnvironment(Path(sys.prefix))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = StubEnvironment(Path(cache_root()) / f"serving-env-py{version}")
    if not _has_stub_numpy(env):
        log(
            f"this Python has numpy {numpy.__version__}, which tritonserver 2.51's stub cannot "
            f"read:"
            f" making a serving environment with {STUB_NUMPY_RULE} at {env.prefix}",
            flush=True,
        )
        _make(env)
    return env


def _has_stub_numpy(env: StubEnvironment) -> bool:
    if not env.python.exists():
        return False
    result = subprocess.run(
        [str(env.python), "-c", "import numpy; print(numpy.__version__)"],
        capture_output=True,
        text=True,
    )
    return result.returncode == 0 and stub_numpy_problem(result.stdout.strip()) is None


def _make(env: StubEnvironment) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(env.prefix)], check=True)
    # The launching environment's packages, after the serving environment's own numpy.
    site = subprocess.run(
        [str(env.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "tritonllm-launching-env.pth").write_text("\n".join(ours) + "\n")
    pip = subprocess.run(
        [str(env.python), "-m", "pip", "install", "-q", STUB_NUMPY_RULE],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0 or not _has_stub_numpy(env):
        raise RuntimeError(
            f"could not install {STUB_NUMPY_RULE} into the serving environment {env.prefix}:\n"
            f"{pip.stderr.strip()[-800:]}\nInstall it there by hand (on a host without network, "
            f"from a wheel: {env.python} -m pip install numpy-1.26.4-cp3*.whl), or set "
            f"PIP_FIND_LINKS to a "
            "folder holding that wheel and start again"
        )

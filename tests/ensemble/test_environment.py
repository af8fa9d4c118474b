"""The stubs' environment: numpy the 2.51 stub can read, else a serving environment or a refusal
that says what to install; the engine under the launching Python."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import numpy
import pytest

from backend.process.client import ENGINE_PYTHON_ENV
from ensemble import environment
from ensemble.environment import StubEnvironment, check_stub_numpy, stub_numpy_problem
from ensemble.server import TritonServer
from ensemble.triton_install import TritonInstall


def test_numpy_2_is_refused_with_what_to_install():
    assert stub_numpy_problem("1.26.4") is None
    problem = stub_numpy_problem("2.1.3")
    assert (
        "numpy 2.1.3" in problem
        and "'numpy<2'" in problem
        and "python -m ensemble serve" in problem
    )
    check_stub_numpy()  # this environment's numpy is 1.x


def test_every_model_checks_the_numpy_before_loading():
    root = Path(__file__).resolve().parents[2] / "model_repository"
    for model in ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        source = (root / model / "1" / "model.py").read_text()
        assert "def initialize(self, args):\n        check_stub_numpy()" in source, model


def test_this_environment_serves_the_stubs_when_its_numpy_suits_them():
    assert environment.stub_environment().prefix == Path(sys.prefix)


def test_a_numpy_2_launcher_without_numpy_1_to_install_refuses_to_start(tmp_path, monkeypatch):
    """Launched from a numpy 2 stack (here: a launcher whose packages hold a numpy 2.2.0) on a
    host where pip finds no numpy < 2: no server starts, and the error says what to install."""
    launcher = tmp_path / "launcher-site-packages"
    (launcher / "numpy").mkdir(parents=True)
    (launcher / "numpy" / "__init__.py").write_text('__version__ = "2.2.0"\n')
    monkeypatch.setattr(numpy, "__version__", "2.2.0")
    monkeypatch.setattr(
        sysconfig, "get_paths", lambda: {"purelib": str(launcher), "platlib": str(launcher)}
    )
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels-here"))
    with pytest.raises(
        RuntimeError, match=r"could not install numpy<2 into the serving environment"
    ):
        environment.stub_environment(log=lambda *a, **k: None)
    made = tmp_path / f"serving-env-py{sys.version_info.major}.{sys.version_info.minor}"
    assert (made / "bin" / "python3").exists()
    pth = list(made.glob("lib/python*/site-packages/tritonllm-launching-env.pth"))
    assert pth and pth[0].read_text().split() == [str(launcher)]  # sees the launcher's packages


def test_the_server_runs_stubs_from_their_environment_and_the_engine_under_this_python(tmp_path):
    server = TritonServer(tmp_path)
    install = TritonInstall(root=tmp_path / "tritonserver", libs=tmp_path / "libs")
    env = server.environment(install, StubEnvironment(tmp_path / "serving-env"))
    assert env["PATH"].startswith(str(tmp_path / "serving-env" / "bin"))
    assert env["VIRTUAL_ENV"] == str(tmp_path / "serving-env")
    assert env[ENGINE_PYTHON_ENV] == sys.executable


def test_the_backends_directory_is_per_python_version_under_the_cache(tmp_path, monkeypatch):
    """A 3.12 checkout must not overwrite the stub a running 3.11 server executes."""
    pytest.importorskip("pytriton")
    from ensemble.triton_install import default_backends_dir, locate_tritonserver, prepare_backends

    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert default_backends_dir() == tmp_path / f"backends-py{version}"
    install = locate_tritonserver()
    stub = prepare_backends(install) / "python" / "triton_python_backend_stub"
    assert stub.read_bytes() == install.stub.read_bytes()
    assert f"/{version}/" in str(install.stub)
